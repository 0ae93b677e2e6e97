"""A run's hold on its lease (core: every integration's runs use it): the lease, its
renewal while the body runs, its loss, and the checks the body makes
(:func:`check_lease`, :func:`current_lease`).

The lease lives on this host's clock: it counts as lost at ``confirmed + ttl -
margin`` (:data:`MARGIN` of the ttl), where ``confirmed`` is when the statement
that granted or last renewed it was *sent* (:attr:`taskguard.Lease.confirmed_at`),
whatever the network does. :func:`check_lease` and :func:`current_lease` read the
clock themselves; the renewer cuts every call at that moment and moves it on with
each confirmed renewal. The database expires the lease no earlier than ``confirmed
+ ttl`` by its own clock, so the loss is declared before anyone else can be granted
the key, as long as the two clocks run at rates within :data:`MARGIN` of each other
(docs/reliability.md).

While a body runs, its :class:`Hold` is renewed every ttl/3 by one daemon thread the
process shares among all its runs; :meth:`Hold.stop_renewing` (before the release)
waits for a renewal in flight, so none outlives the run. The thread exits once it
has had nothing to renew for a couple of seconds.

A renewal that returns ``False`` means the row was taken over, force-released or
had expired: the lease is *lost*: logged, sent as :data:`taskguard.signals.lease_lost`,
and with ``stop_on_lease_loss`` raised in the body (:class:`Interrupter`):

* **prefork** and **solo** (the body in the process's main thread): the renewer
  sends that thread ``SIGUSR2`` (as billiard delivers a soft time limit with
  ``SIGUSR1``); the handler raises the ``LeaseLost``. A blocking ``time.sleep`` or
  socket wait is interrupted; a long C call that holds the GIL, or a ``try/except
  BaseException`` that swallows the error, is not.
* **threads**: ``PyThreadState_SetAsyncExc``: raised when that thread next runs
  Python bytecode (a blocking call delays it until it returns).
* **gevent / eventlet**: nothing can target one greenlet: nothing is raised; call
  :func:`check_lease` before side effects instead.

The error is raised at most once per run and never after the body returned.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from types import FrameType
from typing import Any

from taskguard import signals
from taskguard.deadline import call_limit
from taskguard.exceptions import DatabaseUnavailable, LeaseLost, TaskGuardError
from taskguard.green import green_library
from taskguard.guard import TaskGuard
from taskguard.lease import Lease

__all__ = [
    "MARGIN",
    "Hold",
    "Interrupter",
    "active_run",
    "check_lease",
    "current_lease",
    "enter_run",
    "exit_run",
    "pool_kind",
    "release_when_reachable",
    "renewing",
    "valid_until",
]

log = logging.getLogger("taskguard.celery")


#: The fraction of the ttl by which a holder declares its lease lost before the
#: database can expire it (see the module docstring).
MARGIN = 0.1
#: The reason of a loss declared because the lease ran out by the local clock.
RAN_OUT = "not renewed in time: it ran out by this host's clock"
#: Renew no more often than this (seconds), whatever the ttl.
MIN_INTERVAL = 0.05
#: How long stop_renewing() waits for a renewal in flight before giving up on it.
JOIN_TIMEOUT = 5.0
#: The shared renewer thread exits after this many seconds with nothing to renew.
IDLE_EXIT = 2.0


def valid_until(lease: Lease) -> float:
    """The ``time.monotonic()`` at which this host counts ``lease`` as lost unless a
    renewal confirms it again: ``confirmed + ttl - margin`` (a lease whose
    confirmation time is unknown here counts from now)."""
    confirmed = lease.confirmed_at
    return (time.monotonic() if confirmed is None else confirmed) + lease.ttl * (1.0 - MARGIN)


#: Seconds between attempts of a release that could not reach the lock database.
RELEASE_RETRY = 2.0


def release_when_reachable(
    guard: TaskGuard, leases: Iterable[Lease], why: str, *, landing: bool = False
) -> None:
    """Release ``leases`` now; those that cannot reach the lock database are tried
    again every :data:`RELEASE_RETRY` seconds in a daemon thread until released (or
    expired: then they ended by themselves). For a run or an enqueue that gives up
    because the database is unreachable. ``landing``: a lease an acquire cut off in
    flight (``OutcomeUnknown``) may still be granted later: tried until it is
    released or expires, also after a release that found nothing. Never raises."""
    left = [lease for lease in leases if not _release_reached(guard, lease, why, landing)]
    if left:
        log.warning(
            "lock(s) %s cannot be released now (%s); trying again until they expire",
            ", ".join(repr(lease.key) for lease in left),
            why,
        )
        threading.Thread(
            target=_keep_releasing,
            args=(guard, left, why, landing),
            daemon=True,
            name="taskguard-release",
        ).start()


def _release_reached(guard: TaskGuard, lease: Lease, why: str, landing: bool) -> bool:
    """Whether the release is done: it ended the lease, or found it gone (unless
    ``landing``: then only once it ended it)."""
    try:
        if guard.release(lease):
            log.info("released lock %r (owner %s): %s", lease.key, lease.owner, why)
            return True
    except DatabaseUnavailable:  # also OutcomeUnknown: tried again
        return False
    except TaskGuardError as exc:
        log.error("could not release lock %r (owner %s): %s", lease.key, lease.owner, exc)
    return not landing


def _keep_releasing(guard: TaskGuard, leases: list[Lease], why: str, landing: bool) -> None:
    while leases:
        time.sleep(RELEASE_RETRY)
        now = datetime.now(timezone.utc)
        leases = [
            lease
            for lease in leases
            if lease.expires_at > now and not _release_reached(guard, lease, why, landing)
        ]


class Hold:
    """One run's hold on its lease (``lease`` None: it holds none, e.g. a
    ``lock="queue"`` run): what the body checks, what the renewer renews.
    Integrations' runs subclass it."""

    #: The lease held (None: none, or not yet) and its key.
    lease: Lease | None = None
    key = ""
    #: Set once the lease was lost (the first loss declared, for good).
    lost: LeaseLost | None = None
    #: Set once a retry message carries the lease on: the run must not release it.
    handed_over = False
    #: Raises the loss inside the body (stop_on_lease_loss); None: it only records it.
    interrupter: Interrupter | None = None
    #: When (time.monotonic()) the lease counts as lost unless renewed (see
    #: :func:`valid_until`); moved on by every confirmed renewal.
    valid_until = math.inf
    #: The renewer's: when the next renewal is due; whether one is being sent.
    due = math.inf
    in_flight = False
    #: Named as the sender of :data:`~taskguard.signals.lease_lost`; the task id, logged.
    sender: Any = None
    task_id: str | None = None
    #: The framework's request (Celery's), if any.
    request: Any = None

    def __init__(self, guard: TaskGuard, key: str, lease: Lease | None, request: Any) -> None:
        self.guard, self.key, self.lease, self.request = guard, key, lease, request
        if lease is not None:
            self.valid_until = valid_until(lease)

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

    # -- renewal ----------------------------------------------------------------------

    def start_renewing(self) -> None:
        """Renew the lease every ttl/3 (on the process's renewer thread) until
        :meth:`stop_renewing`."""
        _RENEWER.add(self)

    def stop_renewing(self) -> None:
        """Stop renewing; wait for a renewal in flight, so the caller's release
        comes after it."""
        if not _RENEWER.remove(self):
            log.warning(
                "renewal of %r still in flight after %.0fs; releasing anyway",
                self.key,
                JOIN_TIMEOUT,
            )

    def beat(self, cut_at: float = math.inf) -> float | None:
        """One renewal (on the renewer thread): seconds until the next, or None to
        stop. Every call it makes ends by ``cut_at`` (the earliest moment another
        lease of this process runs out) and by :attr:`valid_until`, connecting
        included."""
        lease = self.lease
        assert lease is not None
        interval = max(lease.ttl / 3.0, MIN_INTERVAL)
        sent = time.monotonic()
        if sent >= self.valid_until or self.lost is not None:
            self._lose(RAN_OUT)
            return None
        try:
            with call_limit(min(cut_at, self.valid_until) - sent):
                ok = self.guard.renew(lease)
        except Exception as exc:  # any failure: we cannot know we still hold it
            if self not in _RENEWER.holds:
                return None  # stopped meanwhile: its release follows
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
            return min(interval, max(MIN_INTERVAL, left / 2), left)
        if self.handed_over:
            return None  # handed to a retry that may already have ended it
        if not ok:
            self._lose("expired or taken over before it could be renewed")
            return None
        if self.lost is not None:
            self._lose(RAN_OUT)  # check_lease() found it ran out while this one was sent
            return None
        self.valid_until = valid_until(lease)
        return interval

    def _lose(self, reason: str) -> None:
        lease = self.lease
        assert lease is not None
        lost = self.declare_lost(reason)
        log.error(
            "lost lock %r (owner %s, task id %s): %s; %s",
            lease.key,
            lease.owner,
            self.task_id,
            lost.reason,
            "stopping the task body (stop_on_lease_loss)"
            if self.interrupter is not None
            else "the task keeps running but must not rely on holding the lock",
        )
        signals.lease_lost.send(sender=self.sender, key=lease.key, lease=lease, reason=lost.reason)
        if self.interrupter is not None:
            self.interrupter.fire(lost)


_current: contextvars.ContextVar[Hold | None] = contextvars.ContextVar(
    "taskguard_active_run", default=None
)


def active_run() -> Hold | None:
    """The guarded run executing in this thread/context, if any."""
    return _current.get()


def enter_run(run: Hold) -> contextvars.Token[Hold | None]:
    return _current.set(run)


def exit_run(token: contextvars.Token[Hold | None]) -> None:
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


class _Renewer:
    """One daemon thread per process that renews every live :class:`Hold` when it
    falls due.

    A thread per run cost more CPU than the two lock statements together (start +
    join on every task). Holds are few (one per running body), so they are kept in
    a set that the thread scans when it wakes: adding or removing one is a set
    operation under the lock, and wakes the thread only when the hold falls due
    before the thread would look again (rare: renewals come every ttl/3, seconds;
    most bodies end sooner). Renewals run one at a time: they all go to the same
    database, so a stall there delays them all alike, and each hold still judges
    its lease by its own deadline. The thread exits after :data:`IDLE_EXIT` seconds
    with nothing to renew, so an idle process keeps no renewer around.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start over empty, with no thread (used in a forked child)."""
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.holds: set[Hold] = set()
        self._thread: threading.Thread | None = None
        #: When the thread looks at the holds again (math.inf: no thread; -inf: it
        #: is looking now).
        self._wake_at = math.inf

    def add(self, hold: Hold) -> None:
        assert hold.lease is not None
        hold.due = time.monotonic() + max(hold.lease.ttl / 3.0, MIN_INTERVAL)
        with self._lock:
            self.holds.add(hold)
            if hold.due < self._wake_at:
                self._wake()

    def _wake(self) -> None:
        # Caller holds the lock.
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="taskguard-renewer", daemon=True
            )
            self._thread.start()
        else:
            self._cond.notify()

    def remove(self, hold: Hold) -> bool:
        """Stop renewing ``hold``; wait (up to :data:`JOIN_TIMEOUT`) for its renewal in
        flight. False if it was still in flight when the wait ended."""
        with self._lock:
            self.holds.discard(hold)
            if hold.in_flight and threading.current_thread() is not self._thread:
                self._cond.wait_for(lambda: not hold.in_flight, JOIN_TIMEOUT)
            return not hold.in_flight or threading.current_thread() is self._thread

    def _loop(self) -> None:
        idle_since = time.monotonic()
        with self._cond:
            while True:
                self._wake_at = -math.inf
                now = time.monotonic()
                hold = min(self.holds, key=_due, default=None)
                if hold is None:
                    if now - idle_since >= IDLE_EXIT:
                        self._thread, self._wake_at = None, math.inf
                        return
                    self._sleep(now, idle_since + IDLE_EXIT)
                    continue
                idle_since = now
                if hold.due > now:
                    self._sleep(now, hold.due)
                    continue
                # Renewals take turns: none may outlive another lease's deadline.
                cut_at = min(h.valid_until for h in self.holds)
                hold.in_flight, hold.due = True, math.inf
                self._cond.release()
                try:
                    delay = hold.beat(cut_at)
                except Exception:  # a bug must not end every other lease's renewals
                    log.exception("renewal of %r failed unexpectedly", hold.key)
                    delay = None
                finally:
                    self._cond.acquire()
                hold.in_flight = False
                if hold in self.holds:
                    if delay is None:
                        self.holds.discard(hold)
                    else:
                        hold.due = time.monotonic() + delay
                self._cond.notify_all()  # a stop_renewing() may be waiting for this renewal

    def _sleep(self, now: float, until: float) -> None:
        self._wake_at = until
        self._cond.wait(until - now)


def _due(hold: Hold) -> float:
    return hold.due


#: The process's renewer. Its thread starts with the first hold.
_RENEWER = _Renewer()


def renewing() -> int:
    """How many holds are being renewed in this process (for tests and diagnostics)."""
    with _RENEWER._lock:
        return len(_RENEWER.holds)


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
    if green_library():
        return "green"
    return "main" if threading.current_thread() is threading.main_thread() else "thread"


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
    """Delivers one :class:`LeaseLost` to the thread running one body (``task``: to an
    asyncio body, by cancelling its task; :meth:`GuardedRun.aexit` raises the loss)."""

    def __init__(self, task_name: str, task: asyncio.Task[Any] | None = None) -> None:
        self.kind = pool_kind() if task is None else "asyncio"
        self.task = task
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
            if self.task is not None:  # before a disarm: lands before the release's result
                self.task.get_loop().call_soon_threadsafe(self.task.cancel)
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
