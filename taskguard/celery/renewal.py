"""The held lease: a guarded run's hold on its lease, its renewal while the body
runs, and the checks the body makes (:func:`check_lease`, :func:`current_lease`).

The lease lives on this host's clock: it counts as lost at ``confirmed + ttl -
margin`` (:data:`MARGIN` of the ttl), where ``confirmed`` is when the statement
that granted or last renewed it was *sent* (:attr:`taskguard.Lease.confirmed_at`),
whatever the network does. :func:`check_lease` and :func:`current_lease` read the
clock themselves; the renewer (:class:`Heartbeat`) cuts every call at
that moment and moves it on with each confirmed renewal. The database expires the
lease no earlier than ``confirmed + ttl`` by its own clock, so the loss is declared
before anyone else can be granted the key, as long as the two clocks run at rates
within :data:`MARGIN` of each other (docs/reliability.md, "The lease on the local
clock").

While a guarded body runs, its lease is renewed every ttl/3 by one daemon thread
the process shares among all its runs. A heartbeat holds the guard, the lease and
a weak reference to the task (only to name it as signal sender): it never keeps
the task object alive, and it is stopped (waiting for a renewal in flight) before
the lease is released, so no renewal outlives the run. The thread itself exits
once it has had nothing to renew for a couple of seconds.

A renewal that returns ``False`` means the row was taken over, force-released or
had expired: the lease is *lost*. The lease also runs out on this host's clock, at
``last confirmed renewal + ttl - margin`` (:func:`valid_until`):
every call the renewer makes, connecting included, is cut at that moment, so it
declares the loss then at the latest: logged, sent as
:data:`taskguard.signals.lease_lost`, and raised in the body with
``stop_on_lease_loss``.

``stop_on_lease_loss=True`` (:class:`Interrupter`): raise :class:`~taskguard.LeaseLost` inside the body
once the lease is lost, at the next point Python allows.

What each pool can do:

* **prefork** and **solo**: the body runs in the process's main thread. The
  renewer thread sends the process's main thread ``SIGUSR2`` (the way billiard
  delivers a soft time limit with ``SIGUSR1``); the handler raises the
  ``LeaseLost`` there. A blocking ``time.sleep`` or socket wait is interrupted
  (Python retries the call after running the handler, which raises). A long
  C call that holds the GIL, or a ``try/except BaseException`` that swallows the
  error, is not interrupted.
* **threads**: the body runs in a pool thread, which no signal reaches. The
  renewer uses ``PyThreadState_SetAsyncExc``: the error is raised when that thread
  next executes Python bytecode, so a blocking call (sleep, socket read) delays
  it until the call returns.
* **gevent / eventlet**: every body shares the main thread; neither a signal nor
  an asynchronous exception can target one greenlet, so nothing is raised. Call
  :func:`taskguard.celery.check_lease` before side effects instead.

The error is raised at most once per run and never after the body returned
(the run disarms it first thing).
"""

from __future__ import annotations

import contextvars
import ctypes
import heapq
import itertools
import logging
import math
import os
import signal
import sys
import threading
import time
import weakref
from types import FrameType
from typing import Any

from taskguard import signals
from taskguard.deadline import call_limit
from taskguard.exceptions import LeaseLost, TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.lease import Lease

__all__ = [
    "INTERRUPT_SIGNAL",
    "MARGIN",
    "RAN_OUT",
    "ActiveRun",
    "Heartbeat",
    "Interrupter",
    "active_run",
    "check_lease",
    "current_lease",
    "enter_run",
    "exit_run",
    "pool_kind",
    "valid_until",
]

log = logging.getLogger("taskguard.celery")


#: The fraction of the ttl by which a holder declares its lease lost before the
#: database can expire it (see the module docstring).
MARGIN = 0.1
#: The reason of a loss declared because the lease ran out by the local clock.
RAN_OUT = "not renewed in time: it ran out by this host's clock"


def valid_until(lease: Lease) -> float:
    """The ``time.monotonic()`` at which this host counts ``lease`` as lost unless a
    renewal confirms it again: ``confirmed + ttl - margin`` (a lease whose
    confirmation time is unknown here counts from now)."""
    confirmed = lease.confirmed_at
    if confirmed is None:
        confirmed = time.monotonic()
    return confirmed + lease.ttl * (1.0 - MARGIN)


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
        "valid_until",
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
        #: When (time.monotonic()) the lease counts as lost unless renewed (see
        #: :func:`valid_until`); moved on by every confirmed renewal.
        self.valid_until = valid_until(lease) if lease is not None else math.inf

    def declare_lost(self, reason: str) -> LeaseLost:
        """The run's :class:`LeaseLost`: the first one declared, for good."""
        lost = self.lost
        if lost is None:
            assert self.lease is not None
            lost = self.lost = LeaseLost(
                self.key, self.lease.owner, f"{reason} (token {self.lease.token})"
            )
        return lost

    def check(self) -> None:
        """Raise the run's :class:`LeaseLost` if it was lost, or ran out by this
        host's clock."""
        if self.lost is not None:
            raise self.lost
        if time.monotonic() >= self.valid_until:
            raise self.declare_lost(RAN_OUT)


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

    With ``check`` (the default) raises :class:`~taskguard.LeaseLost` if the lease
    was lost or ran out by this host's clock (as :func:`check_lease`);
    ``check=False`` returns it anyway (e.g. to log its token).
    """
    run = _current.get()
    if run is None or run.lease is None:
        return None
    if check:
        run.check()
    return run.lease


def check_lease(*, verify: bool = False) -> Lease:
    """Raise :class:`~taskguard.LeaseLost` unless this run still holds its lease.

    Without ``verify`` this reads this host's clock and what the renewer found (no
    round trip): the lease counts as lost from ``last confirmed renewal + ttl -
    margin`` on, whatever the network does. With ``verify`` the database is asked
    too (within the same deadline). Call it before side effects that must not
    happen twice, and fence writes with the lease's token: a process paused after
    this check can still act late. Raises :class:`~taskguard.TaskGuardError`
    outside a run that holds a lease.
    """
    run = _current.get()
    if run is None or run.lease is None:
        raise TaskGuardError("check_lease() called outside a guarded run that holds a lease")
    run.check()
    if verify:
        try:
            with call_limit(run.valid_until - time.monotonic()):
                held = run.guard.is_held_by(run.lease)
        except TaskGuardError:
            run.check()  # ran out meanwhile: that is the answer
            raise
        if not held:
            raise run.declare_lost("no longer held (found on verify)")
    return run.lease


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
        # Runs take the plain lock (no Python-level Condition.__enter__ per run); the
        # condition over it wakes the thread and waits for a renewal in flight.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, Heartbeat]] = []
        self._seq = itertools.count()
        self._live = 0
        self._thread: threading.Thread | None = None
        #: When the thread, waiting on the condition, looks at the heap again; None
        #: while it is not waiting (it looks before it waits again).
        self._wake_at: float | None = None

    def schedule(self, beat: Heartbeat, delay: float) -> None:
        due = time.monotonic() + delay
        with self._lock:
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
        with self._lock:
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


# -- stop_on_lease_loss ------------------------------------------------------------------


#: Signal used to interrupt a body running in a process's main thread.
INTERRUPT_SIGNAL = signal.SIGUSR2

# The run armed in this process's main thread (one at a time: prefork and solo run
# one task per process).
_main_armed: dict[str, Interrupter] = {}
_installed: dict[str, Any] = {}
_warned: set[str] = set()


def pool_kind() -> str:
    """``"main"`` (prefork/solo), ``"thread"`` (threads pool) or ``"green"``."""
    if _green():
        return "green"
    return "main" if threading.current_thread() is threading.main_thread() else "thread"


def _green() -> bool:
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return True
    patcher = sys.modules.get("eventlet.patcher")
    return bool(patcher is not None and patcher.is_monkey_patched("thread"))


def _handler(signum: int, frame: FrameType | None) -> None:
    armed = _main_armed.get("run")
    if armed is not None and armed._take() is not None:
        raise armed.error  # type: ignore[misc]
    previous = _installed.get("previous")
    if callable(previous):
        previous(signum, frame)


def _install() -> bool:
    if "previous" in _installed:
        return True
    try:
        _installed["previous"] = signal.signal(INTERRUPT_SIGNAL, _handler)
    except (ValueError, OSError) as exc:  # not the main thread, or no such signal
        log.warning("stop_on_lease_loss: cannot install the signal handler: %s", exc)
        return False
    return True


class Interrupter:
    """Delivers one :class:`LeaseLost` to the thread running one body."""

    def __init__(self, task_name: str) -> None:
        self.kind = pool_kind()
        self.ident = threading.get_ident()
        self.error: LeaseLost | None = None
        self._lock = threading.Lock()
        self._armed = False
        self._fired = False
        if self.kind == "green" and task_name not in _warned:
            _warned.add(task_name)
            log.warning(
                "%s: stop_on_lease_loss cannot interrupt a body in a gevent/eventlet pool; "
                "call check_lease() before side effects",
                task_name,
            )

    def arm(self) -> Interrupter:
        if self.kind == "main" and not _install():
            self.kind = "none"
        with self._lock:
            self._armed = True
        if self.kind == "main":
            _main_armed["run"] = self
        return self

    def fire(self, error: LeaseLost) -> None:
        """From the renewer thread: raise ``error`` in the body's thread."""
        with self._lock:
            if not self._armed or self._fired:
                return
            self._fired = True
            self.error = error
        if self.kind == "main":
            signal.pthread_kill(self.ident, INTERRUPT_SIGNAL)
        elif self.kind == "thread":
            lost = error

            class _Lost(LeaseLost):
                # SetAsyncExc raises a class: this one rebuilds the real error.
                def __init__(self) -> None:
                    super().__init__(lost.key, lost.owner, lost.reason)

            _Lost.__name__ = _Lost.__qualname__ = "LeaseLost"
            _Lost.__module__ = LeaseLost.__module__
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.ident), ctypes.py_object(_Lost)
            )

    def _take(self) -> LeaseLost | None:
        with self._lock:
            return self.error if self._armed and self._fired else None

    def disarm(self) -> None:
        """In the body's thread, right after the body: no error is raised from now on."""
        with self._lock:
            self._armed = False
            fired = self._fired
        if self.kind == "main" and _main_armed.get("run") is self:
            del _main_armed["run"]
        if fired and self.kind == "thread":
            # Cancel an asynchronous error not yet raised.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), None)
