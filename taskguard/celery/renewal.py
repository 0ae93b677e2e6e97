"""Keeping a running task's lease alive, and telling the task when it is lost
(the run and the body's checks: :mod:`taskguard.celery.holding`).

While a guarded body runs, its lease is renewed every ttl/3 by one daemon thread
the process shares among all its runs. A heartbeat holds the guard, the lease and
a weak reference to the task (only to name it as signal sender): it never keeps
the task object alive, and it is stopped (waiting for a renewal in flight) before
the lease is released, so no renewal outlives the run. The thread itself exits
once it has had nothing to renew for a couple of seconds.

A renewal that returns ``False`` means the row was taken over, force-released or
had expired: the lease is *lost*. The lease also runs out on this host's clock, at
``last confirmed renewal + ttl - margin`` (:func:`~taskguard.celery.holding.valid_until`):
every call the renewer makes, connecting included, is cut at that moment, so it
declares the loss then at the latest: logged, sent as
:data:`taskguard.signals.lease_lost`, and raised in the body with
``stop_on_lease_loss``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
import weakref
from typing import Any

from taskguard import signals
from taskguard.celery.holding import (
    RAN_OUT,
    ActiveRun,
    active_run,
    check_lease,
    current_lease,
    enter_run,
    exit_run,
    valid_until,
)
from taskguard.deadline import call_limit
from taskguard.exceptions import LeaseLost

__all__ = [
    "ActiveRun",
    "Heartbeat",
    "active_run",
    "check_lease",
    "current_lease",
    "enter_run",
    "exit_run",
]

log = logging.getLogger("taskguard.celery")

#: Renew no more often than this (seconds), whatever the ttl.
MIN_INTERVAL = 0.05
#: How long stop() waits for an in-flight renewal before giving up on it.
JOIN_TIMEOUT = 5.0
#: The shared renewer thread exits after this many seconds with nothing to renew.
IDLE_EXIT = 2.0


class Heartbeat:
    """Renews ``run.lease`` every ttl/3 until :meth:`stop`, on the process's
    shared renewer thread (see :class:`_Renewer`)."""

    __slots__ = (
        "_guard",
        "_in_flight",
        "_interval",
        "_lease",
        "_run_ref",
        "_stopped",
        "_task_id",
        "_task_ref",
        "valid_until",
    )

    def __init__(self, run: ActiveRun, task: Any, task_id: str | None) -> None:
        assert run.lease is not None
        self._guard = run.guard
        self._lease = run.lease
        self._run_ref = weakref.ref(run)
        self._task_ref = weakref.ref(task) if task is not None else None
        self._task_id = task_id
        self._interval = max(run.lease.ttl / 3.0, MIN_INTERVAL)
        #: When the lease counts as lost unless renewed (the run's, kept here too so
        #: the renewer never reads it through a dead weak reference).
        self.valid_until = run.valid_until
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

    def beat(self, cut_at: float = math.inf) -> float | None:
        """One renewal (on the renewer thread): seconds until the next, or None to
        stop. Every call it makes ends by ``cut_at`` (the earliest moment another
        lease of this process runs out) and by this lease's own :attr:`valid_until`,
        connecting included."""
        lease = self._lease
        run = self._run_ref()
        sent = time.monotonic()
        if sent >= self.valid_until or (run is not None and run.lost is not None):
            self._lose(RAN_OUT)
            return None
        try:
            with call_limit(min(cut_at, self.valid_until) - sent):
                ok = self._guard.renew(lease)
        except Exception as exc:  # any failure: we cannot know we still hold it
            if self._stopped:
                return None
            left = self.valid_until - time.monotonic()
            if left <= 0:
                self._lose(f"{RAN_OUT}; renewal failed ({exc})")
                return None
            log.warning(
                "could not renew lock %r (owner %s): %s; retrying for %.1fs more",
                lease.key,
                lease.owner,
                exc,
                left,
            )
            # Try again soon, and once more right when it runs out (to declare it).
            return min(self._interval, max(MIN_INTERVAL, left / 2), left)
        if self._stopped or (run is not None and run.handed_over):
            return None  # released, or handed to a retry that may already have ended it
        if not ok:
            self._lose("expired or taken over before it could be renewed")
            return None
        if run is not None and run.lost is not None:
            self._lose(RAN_OUT)  # check_lease() found it ran out while this one was sent
            return None
        self.valid_until = valid_until(lease)
        if run is not None:
            run.valid_until = self.valid_until
        return self._interval

    def _lose(self, reason: str) -> None:
        lease = self._lease
        run = self._run_ref()
        stopping = run is not None and run.interrupter is not None
        if run is not None:
            lost = run.declare_lost(reason)
            reason = lost.reason
        else:
            lost = LeaseLost(lease.key, lease.owner, f"{reason} (token {lease.token})")
        log.error(
            "lost lock %r (owner %s, task id %s): %s; %s",
            lease.key,
            lease.owner,
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
                # Renewals take turns: none may outlive another lease's deadline.
                cut_at = min(
                    (b.valid_until for _, _, b in self._heap if not b._stopped),
                    default=math.inf,
                )
            try:
                delay = beat.beat(cut_at)
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
