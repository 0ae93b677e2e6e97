"""Celery-style signals taskguard sends. Connect like any Celery signal::

    from taskguard.signals import lock_conflict

    @lock_conflict.connect
    def on_conflict(sender, key, holder, **kwargs): ...

``sender`` is the task (or ``None`` outside Celery). Receivers run synchronously
in the sending process; a receiver that raises is logged by Celery and ignored.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lease_lost", "lock_acquired", "lock_conflict", "lock_released", "locks_reaped"]

#: A lease was granted. kwargs: ``key``, ``lease``.
lock_acquired = Signal(name="taskguard.lock_acquired")
#: The key was held by someone else. kwargs: ``key``, ``holder`` (LockInfo or None), ``action``
#: (what the caller does about it, e.g. "skip", "raise", "retry", "existing").
lock_conflict = Signal(name="taskguard.lock_conflict")
#: A lease was given back. kwargs: ``key``, ``lease``, ``held_for`` (seconds), ``released`` (bool:
#: False if it had already expired or been taken over).
lock_released = Signal(name="taskguard.lock_released")
#: A renewal failed: the lease expired, was taken over, or the database was unreachable.
#: kwargs: ``key``, ``lease``, ``reason``.
lease_lost = Signal(name="taskguard.lease_lost")
#: The reaper removed expired rows. kwargs: ``count``.
locks_reaped = Signal(name="taskguard.locks_reaped")
