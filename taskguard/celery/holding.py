"""A guarded run's hold on its lease, and the checks its body makes.

The lease lives on this host's clock: it counts as lost at ``confirmed + ttl -
margin`` (:data:`MARGIN` of the ttl), where ``confirmed`` is when the statement
that granted or last renewed it was *sent* (:attr:`taskguard.Lease.confirmed_at`),
whatever the network does. :func:`check_lease` and :func:`current_lease` read the
clock themselves; the renewer (:mod:`taskguard.celery.renewal`) cuts every call at
that moment and moves it on with each confirmed renewal. The database expires the
lease no earlier than ``confirmed + ttl`` by its own clock, so the loss is declared
before anyone else can be granted the key, as long as the two clocks run at rates
within :data:`MARGIN` of each other (docs/reliability.md, "The lease on the local
clock").
"""

from __future__ import annotations

import contextvars
import math
import time
from typing import Any

from taskguard.celery.interrupt import Interrupter
from taskguard.deadline import call_limit
from taskguard.exceptions import LeaseLost, TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.lease import Lease

__all__ = [
    "MARGIN",
    "RAN_OUT",
    "ActiveRun",
    "active_run",
    "check_lease",
    "current_lease",
    "enter_run",
    "exit_run",
    "valid_until",
]

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
