"""Celery-style signals taskguard sends (from :mod:`taskguard.celery`; this module
only declares them, so receivers can connect without importing the glue).
Connect like any Celery signal::

    from taskguard.signals import lock_conflict

    @lock_conflict.connect
    def on_conflict(sender, key, holder, **kwargs): ...

``sender`` is the task (or ``None`` outside Celery). Receivers run synchronously
in the sending process; a receiver that raises is logged by Celery and ignored.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "late_copy_dropped",
    "lease_lost",
    "lock_acquired",
    "lock_conflict",
    "lock_released",
    "locks_reaped",
    "run_coalesced",
    "run_deferred",
]

#: A lease was granted. kwargs: ``key``, ``lease``.
lock_acquired = Signal(name="taskguard.lock_acquired")
#: The key was held by someone else. kwargs: ``key``, ``holder`` (LockInfo or None), ``action``
#: (what the caller does about it, e.g. "skip", "raise", "retry", "existing"); from a run
#: of ``on_conflict="wait"`` also ``waited`` (seconds it waited before it was refused).
lock_conflict = Signal(name="taskguard.lock_conflict")
#: A lease was given back. kwargs: ``key``, ``lease``, ``held_for`` (seconds), ``released`` (bool:
#: False if it had already expired or been taken over).
lock_released = Signal(name="taskguard.lock_released")
#: A renewal failed: the lease expired, was taken over, or the database was unreachable.
#: kwargs: ``key``, ``lease``, ``reason``.
lease_lost = Signal(name="taskguard.lease_lost")
#: The reaper removed expired rows. kwargs: ``count``.
locks_reaped = Signal(name="taskguard.locks_reaped")
#: A copy of a message whose task id already finished was dropped without running
#: (see taskguard.celery.lease_calls). kwargs: ``key``, ``task_id``.
late_copy_dropped = Signal(name="taskguard.late_copy_dropped")
#: A start was put off without taking a worker slot: published again with a countdown.
#: kwargs: ``key``, ``task_id``, ``reason`` ("rate": over ``rate=``; "busy": a
#: ``rate=`` task without ``on_conflict`` found the key held; "coalesce": the
#: pending run of ``on_conflict="coalesce"`` waits for the running one; "redelivery":
#: a copy of a task id waits for its other delivery's run; "outage": the
#: lock database could not be reached before the body started), ``countdown``.
run_deferred = Signal(name="taskguard.run_deferred")
#: A submission of an ``on_conflict="coalesce"`` task was merged into the key's
#: pending run instead of being published. kwargs: ``key``, ``task_id`` (the merged
#: submission), ``into`` (the pending run's task id), ``replaced`` (True when the
#: submission's arguments replaced the pending run's: it is the new pending run).
run_coalesced = Signal(name="taskguard.run_coalesced")
