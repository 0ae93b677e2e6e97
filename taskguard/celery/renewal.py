"""Keeping a running task's lease alive, and telling the task when it is lost.

While a guarded body runs, a small daemon thread renews the lease every ttl/3.
The thread holds the guard, the lease and a weak reference to the task (only to
name it as signal sender): it never keeps the task object alive, and it is
stopped and joined before the lease is released, so it does not outlive the run.

A renewal that returns ``False`` means the row was taken over, force-released or
had expired: the lease is *lost*. A renewal that cannot reach the database is
retried until the lease would have expired by the local clock, then the lease is
lost too. Losing a lease is logged, sent as :data:`taskguard.signals.lease_lost`
and visible to the body through :func:`current_lease` / :func:`check_lease`.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import weakref
from typing import Any

from taskguard import signals
from taskguard.exceptions import LeaseLost, TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.lease import Lease

__all__ = ["ActiveRun", "Heartbeat", "check_lease", "current_lease"]

log = logging.getLogger("taskguard.celery")

#: Renew no more often than this (seconds), whatever the ttl.
MIN_INTERVAL = 0.05
#: How long stop() waits for an in-flight renewal before giving up on joining.
JOIN_TIMEOUT = 5.0


class ActiveRun:
    """The lease (if any) of the guarded run executing in this context."""

    __slots__ = (
        "__weakref__",
        "claim",
        "guard",
        "handed_over",
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
        claim: Lease | None = None,
    ) -> None:
        self.guard = guard
        self.key = key
        self.lease = lease
        #: The hand-off claim row held alongside (see taskguard.celery.handoff).
        self.claim = claim
        #: The Celery request this run serves (identity tells nested runs apart).
        self.request = request
        self.lost: LeaseLost | None = None
        #: Set once a retry message carries the lease on: the run must not release it.
        self.handed_over = False
        self.started = time.monotonic()


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
    """Renews ``run.lease`` every ttl/3 on a daemon thread until :meth:`stop`."""

    def __init__(self, run: ActiveRun, task: Any, task_id: str | None) -> None:
        assert run.lease is not None
        self._guard = run.guard
        self._lease = run.lease
        self._run_ref = weakref.ref(run)
        self._task_ref = weakref.ref(task) if task is not None else None
        self._task_id = task_id
        self._interval = max(run.lease.ttl / 3.0, MIN_INTERVAL)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop,
            name=f"taskguard-renew[{run.key[:60]}]",
            daemon=True,
        )

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing and wait for an in-flight renewal to finish."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT)
            if self._thread.is_alive():
                log.warning(
                    "renewal of %r still in flight after %.0fs; releasing anyway",
                    self._lease.key,
                    JOIN_TIMEOUT,
                )

    def _loop(self) -> None:
        lease = self._lease
        # Local estimate of the lease's end; only used while the database is unreachable.
        deadline = time.monotonic() + lease.ttl
        wait = self._interval
        while not self._stop.wait(wait):
            sent = time.monotonic()
            try:
                ok = self._guard.renew(lease)
            except Exception as exc:  # any failure: we cannot know we still hold it
                if self._stop.is_set():
                    return
                margin = 0.1 * lease.ttl
                if time.monotonic() >= deadline - margin:
                    self._lose(f"renewal failed until the lease ran out ({exc})")
                    return
                log.warning(
                    "could not renew lock %r (owner %s): %s; retrying while it lasts",
                    lease.key,
                    lease.owner,
                    exc,
                )
                wait = max(MIN_INTERVAL, min(self._interval, (deadline - margin - sent) / 2))
                continue
            run = self._run_ref()
            if self._stop.is_set() or (run is not None and run.handed_over):
                return  # released, or handed to a retry that may already have ended it
            if not ok:
                self._lose("expired or taken over before it could be renewed")
                return
            deadline = sent + lease.ttl
            wait = self._interval
            self._renew_extra()

    def _renew_extra(self) -> None:
        # The hand-off claim (read from the run each time: a retry may have let it go).
        run = self._run_ref()
        claim = run.claim if run is not None else None
        if claim is None:
            return
        try:
            ok, why = self._guard.renew(claim), "expired or taken over"
        except Exception as exc:
            ok, why = False, str(exc)
        if not ok and not self._stop.is_set() and run is not None and run.claim is claim:
            log.warning("could not renew companion lock %r: %s", claim.key, why)
            run.claim = None

    def _lose(self, reason: str) -> None:
        lease = self._lease
        lost = LeaseLost(lease.key, lease.owner, reason)
        run = self._run_ref()
        if run is not None:
            run.lost = lost
        log.error(
            "lost lock %r (owner %s, token %d, task id %s): %s; the task keeps running "
            "but must not rely on holding the lock",
            lease.key,
            lease.owner,
            lease.token,
            self._task_id,
            reason,
        )
        sender = self._task_ref() if self._task_ref is not None else None
        signals.lease_lost.send(sender=sender, key=lease.key, lease=lease, reason=reason)
