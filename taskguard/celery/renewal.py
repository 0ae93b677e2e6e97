"""Keeping a running task's lease alive, and telling the task when it is lost.

While a guarded body runs, its lease is renewed every ttl/3 by one daemon thread
the process shares among all its runs. A heartbeat holds the guard, the lease and
a weak reference to the task (only to name it as signal sender): it never keeps
the task object alive, and it is stopped (waiting for a renewal in flight) before
the lease is released, so no renewal outlives the run. The thread itself exits
once it has had nothing to renew for a couple of seconds.

A renewal that returns ``False`` means the row was taken over, force-released or
had expired: the lease is *lost*. A renewal that cannot reach the database is
retried until the lease would have expired by the local clock, then the lease is
lost too. Losing a lease is logged, sent as :data:`taskguard.signals.lease_lost`
and visible to the body through :func:`current_lease` / :func:`check_lease`.
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any

from taskguard import signals
from taskguard.celery.interrupt import Interrupter
from taskguard.deadline import call_limit
from taskguard.exceptions import LeaseLost, TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.lease import Lease

__all__ = ["ActiveRun", "Heartbeat", "check_lease", "current_lease"]

log = logging.getLogger("taskguard.celery")

#: Renew no more often than this (seconds), whatever the ttl.
MIN_INTERVAL = 0.05
#: How long stop() waits for an in-flight renewal before giving up on it.
JOIN_TIMEOUT = 5.0
#: The shared renewer thread exits after this many seconds with nothing to renew.
IDLE_EXIT = 2.0


class ActiveRun:
    """The lease (if any) of the guarded run executing in this context."""

    __slots__ = (
        "__weakref__",
        "guard",
        "handed_over",
        "interrupter",
        "key",
        "lease",
        "lost",
        "request",
        "started",
    )

    def __init__(
        self,
        guard: TaskGuard,
        key: str,
        lease: Lease | None,
        request: Any,
    ) -> None:
        self.guard = guard
        self.key = key
        self.lease = lease
        #: The Celery request this run serves (identity tells nested runs apart).
        self.request = request
        self.lost: LeaseLost | None = None
        #: Set once a retry message carries the lease on: the run must not release it.
        self.handed_over = False
        self.started = time.monotonic()
        #: Raises the loss inside the body (stop_on_lease_loss); None: it only records it.
        self.interrupter: Interrupter | None = None


_current: contextvars.ContextVar[ActiveRun | None] = contextvars.ContextVar(
    "taskguard_active_run", default=None
)


def active_run() -> ActiveRun | None:
    """The guarded run executing in this thread/context, if any."""
    return _current.get()


def enter_run(run: ActiveRun) -> contextvars.Token[ActiveRun | None]:
    return _current.set(run)


def exit_run(token: contextvars.Token[ActiveRun | None]) -> None:
    _current.reset(token)


def current_lease(*, check: bool = True) -> Lease | None:
    """The lease held by the guarded task running here, or ``None`` (outside a
    guarded run, or in a ``lock="queue"`` run, which holds nothing while it runs).

    With ``check`` (the default) raises :class:`~taskguard.LeaseLost` if renewing
    the lease failed; ``check=False`` returns it anyway (e.g. to log its token).
    """
    run = _current.get()
    if run is None or run.lease is None:
        return None
    if check and run.lost is not None:
        raise run.lost
    return run.lease


def check_lease(*, verify: bool = False) -> Lease:
    """Raise :class:`~taskguard.LeaseLost` unless this run still holds its lease.

    Without ``verify`` this only consults the renewer (no round trip); with it, the
    database is asked too. Call it before side effects that must not happen twice.
    Raises :class:`~taskguard.TaskGuardError` outside a run that holds a lease.
    """
    run = _current.get()
    if run is None or run.lease is None:
        raise TaskGuardError("check_lease() called outside a guarded run that holds a lease")
    if run.lost is not None:
        raise run.lost
    if verify and not run.guard.is_held_by(run.lease):
        run.lost = LeaseLost(run.key, run.lease.owner, "no longer held (found on verify)")
        raise run.lost
    return run.lease


class Heartbeat:
    """Renews ``run.lease`` every ttl/3 until :meth:`stop`, on the process's
    shared renewer thread (see :class:`_Renewer`)."""

    __slots__ = (
        "_deadline",
        "_guard",
        "_in_flight",
        "_interval",
        "_lease",
        "_run_ref",
        "_stopped",
        "_task_id",
        "_task_ref",
    )

    def __init__(self, run: ActiveRun, task: Any, task_id: str | None) -> None:
        assert run.lease is not None
        self._guard = run.guard
        self._lease = run.lease
        self._run_ref = weakref.ref(run)
        self._task_ref = weakref.ref(task) if task is not None else None
        self._task_id = task_id
        self._interval = max(run.lease.ttl / 3.0, MIN_INTERVAL)
        # Local estimate of the lease's end; only used while the database is unreachable.
        self._deadline = time.monotonic() + run.lease.ttl
        #: Both guarded by the renewer's condition.
        self._stopped = False
        self._in_flight = False

    def start(self) -> Heartbeat:
        _renewer().schedule(self, self._interval)
        return self

    def stop(self) -> None:
        """Stop renewing and wait for an in-flight renewal of this lease to finish,
        so the caller's release comes after it."""
        if not _renewer().cancel(self, JOIN_TIMEOUT):
            log.warning(
                "renewal of %r still in flight after %.0fs; releasing anyway",
                self._lease.key,
                JOIN_TIMEOUT,
            )

    def beat(self) -> float | None:
        """One renewal (on the renewer thread): seconds until the next, or None to stop."""
        lease = self._lease
        sent = time.monotonic()
        margin = 0.1 * lease.ttl
        try:
            # A renewal that hangs (a commit waiting for a stopped synchronous standby)
            # must not outlive the lease: it is cut before the local estimate of the
            # expiry, so the lease is declared lost while the database still holds it.
            with call_limit(max(MIN_INTERVAL, self._deadline - margin - sent)):
                ok = self._guard.renew(lease)
        except Exception as exc:  # any failure: we cannot know we still hold it
            if self._stopped:
                return None
            if time.monotonic() >= self._deadline - margin:
                self._lose(f"renewal failed until the lease ran out ({exc})")
                return None
            log.warning(
                "could not renew lock %r (owner %s): %s; retrying while it lasts",
                lease.key,
                lease.owner,
                exc,
            )
            return max(MIN_INTERVAL, min(self._interval, (self._deadline - margin - sent) / 2))
        run = self._run_ref()
        if self._stopped or (run is not None and run.handed_over):
            return None  # released, or handed to a retry that may already have ended it
        if not ok:
            self._lose("expired or taken over before it could be renewed")
            return None
        self._deadline = sent + lease.ttl
        return self._interval

    def _lose(self, reason: str) -> None:
        lease = self._lease
        run = self._run_ref()
        stopping = run is not None and run.interrupter is not None
        lost = LeaseLost(lease.key, lease.owner, f"{reason} (token {lease.token})")
        if run is not None:
            run.lost = lost
        log.error(
            "lost lock %r (owner %s, token %d, task id %s): %s; %s",
            lease.key,
            lease.owner,
            lease.token,
            self._task_id,
            reason,
            "stopping the task body (stop_on_lease_loss)"
            if stopping
            else "the task keeps running but must not rely on holding the lock",
        )
        sender = self._task_ref() if self._task_ref is not None else None
        signals.lease_lost.send(sender=sender, key=lease.key, lease=lease, reason=reason)
        if run is not None and run.interrupter is not None:
            run.interrupter.fire(lost)


class _Renewer:
    """One daemon thread per process that runs every live :class:`Heartbeat` when
    it is due.

    A thread per guarded run cost more CPU than the two lock statements together
    (start + join on every task; docs/benchmarks.md). The shared thread keeps a
    heap of due times; stopping a heartbeat only marks it (a stopped entry is
    skipped when it comes up, and the heap is compacted once stopped entries
    outnumber live ones). The thread exits after :data:`IDLE_EXIT` seconds with
    nothing to renew, so an idle process keeps no renewer around. Renewals run
    one at a time: they all go to the same database, so a stall there delays
    them all alike, and each heartbeat still judges its lease by its own deadline.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start over empty, with no thread (used in a forked child)."""
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Heartbeat]] = []
        self._seq = itertools.count()
        self._live = 0
        self._thread: threading.Thread | None = None
        #: When the thread, waiting on the condition, looks at the heap again; None
        #: while it is not waiting (it looks before it waits again).
        self._wake_at: float | None = None

    def schedule(self, beat: Heartbeat, delay: float) -> None:
        due = time.monotonic() + delay
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), beat))
            self._live += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="taskguard-renewer", daemon=True
                )
                self._thread.start()
            elif self._wake_at is not None and due < self._wake_at:
                # Only when the sleeping thread would look too late. Waking it for
                # every run (as when it had popped the last, stopped, entry) cost a
                # thread switch per task, more than the rest of the run side.
                self._cond.notify()

    def cancel(self, beat: Heartbeat, timeout: float) -> bool:
        """Stop ``beat``; wait (up to ``timeout``) for its renewal in flight.
        False if it was still in flight when the wait ended."""
        with self._cond:
            if not beat._stopped:
                beat._stopped = True
                self._drop_one()
            if beat._in_flight and threading.current_thread() is not self._thread:
                self._cond.wait_for(lambda: not beat._in_flight, timeout)
            return not beat._in_flight or threading.current_thread() is self._thread

    def scheduled(self) -> int:
        """How many heartbeats are live (for tests and diagnostics)."""
        with self._cond:
            return self._live

    def _drop_one(self) -> None:
        # Caller holds the condition and has just marked one heartbeat stopped; its
        # entry (unless in flight) stays in the heap until popped or compacted.
        self._live -= 1
        if len(self._heap) > 32 and self._live < len(self._heap) // 2:
            self._heap = [entry for entry in self._heap if not entry[2]._stopped]
            heapq.heapify(self._heap)

    def _loop(self) -> None:
        while True:
            with self._cond:
                beat = self._next_due()
                if beat is None:
                    return
                beat._in_flight = True
            try:
                delay = beat.beat()
            except Exception:  # a bug must not end every other lease's renewals
                log.exception("renewal of %r failed unexpectedly", beat._lease.key)
                delay = None
            with self._cond:
                beat._in_flight = False
                if not beat._stopped:
                    if delay is None:
                        beat._stopped = True
                        self._drop_one()
                    else:
                        due = time.monotonic() + delay
                        heapq.heappush(self._heap, (due, next(self._seq), beat))
                self._cond.notify_all()  # a stop() may be waiting for this renewal

    def _next_due(self) -> Heartbeat | None:
        """Wait (holding the condition) for the next live heartbeat to fall due;
        None when idle long enough to exit."""
        idle_since: float | None = None
        while True:
            while self._heap and self._heap[0][2]._stopped:
                heapq.heappop(self._heap)
            now = time.monotonic()
            if not self._heap:
                idle_since = idle_since if idle_since is not None else now
                if now - idle_since >= IDLE_EXIT:
                    self._thread = None
                    return None
                self._sleep(now, IDLE_EXIT - (now - idle_since))
                continue
            idle_since = None
            due, _, beat = self._heap[0]
            if due <= now:
                heapq.heappop(self._heap)
                return beat
            self._sleep(now, due - now)

    def _sleep(self, now: float, seconds: float) -> None:
        self._wake_at = now + seconds
        try:
            self._cond.wait(seconds)
        finally:
            self._wake_at = None


#: The process's renewer. Its thread starts with the first heartbeat.
_RENEWER = _Renewer()


def _renewer() -> _Renewer:
    return _RENEWER


if hasattr(os, "register_at_fork"):
    # The thread did not survive the fork and its lock may have been held: a child
    # (a prefork pool process) starts over with an empty renewer of its own.
    os.register_at_fork(after_in_child=_RENEWER.reset)
