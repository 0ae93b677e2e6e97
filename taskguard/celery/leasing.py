"""Taking, describing and giving back leases on behalf of a task.

One attempt reads the holder with the same call that found the conflict
(:meth:`TaskGuard.try_acquire`); a release never raises (the lease then ends by
expiry); every release is announced with :data:`taskguard.signals.lock_released`.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

from taskguard import signals
from taskguard.config import setting
from taskguard.exceptions import TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.keys import MAX_TTL, validate_ttl
from taskguard.lease import Lease, LockInfo, Marker

__all__ = [
    "acquire_or_holder",
    "clamp_ttl",
    "default_ttl",
    "describe_holder",
    "held_seconds",
    "lease_from_info",
    "release_quietly",
    "send_released",
]

log = logging.getLogger("taskguard.celery")


def default_ttl(app: Any, ttl: float | None) -> float:
    if ttl is not None:
        return ttl
    return validate_ttl(setting(app, "taskguard_default_ttl"), name="taskguard_default_ttl")


def clamp_ttl(seconds: float) -> float:
    return min(MAX_TTL, max(seconds, 0.001))


def describe_holder(holder: LockInfo | None) -> str:
    return (
        holder.describe()
        if holder is not None
        else "a holder that released before it could be read"
    )


#: A conflict whose holder was gone when it was read means the key had just been
#: released: it is tried again this many times (then reported with holder None).
ATTEMPTS_WHEN_FREED = 3


def acquire_or_holder(
    guard: TaskGuard, key: str, ttl: float, **details: Any
) -> tuple[Lease | None, LockInfo | None]:
    """``(lease, None)``, or ``(None, holder)`` when the key is held, with the holder
    read by the same :meth:`TaskGuard.try_acquire` call. A conflict whose holder
    released before it could be read is tried again (the key is likely free now)."""
    for _ in range(ATTEMPTS_WHEN_FREED):
        attempt = guard.try_acquire(key, ttl, **details)
        if attempt.lease is not None or attempt.holder is not None:
            break
    return attempt.lease, attempt.holder


def lease_from_info(info: LockInfo, min_hold: float | None = None) -> Lease:
    """A :class:`Lease` for a row read from the table (to release it by owner).
    Pass the task's ``min_hold`` so the release keeps its throttle window."""
    ttl = max((info.expires_at - info.acquired_at).total_seconds(), 0.001)
    return Lease(
        info.key,
        info.owner,
        info.token,
        info.acquired_at,
        info.expires_at,
        ttl,
        info.slot,
        min_hold or 0.0,
    )


def release_quietly(guard: TaskGuard, lease: Lease, marker: Marker | None = None) -> bool:
    """Release without raising (a failure is logged; the lease then ends by expiry)."""
    try:
        return guard.release(lease, marker=marker)
    except TaskGuardError as exc:
        log.error(
            "could not release lock %r (owner %s): %s; it ends by expiry at %s",
            lease.key,
            lease.owner,
            exc,
            lease.expires_at.isoformat(),
        )
        return False


def send_released(sender: Any, lease: Lease, released: bool, held_for: float) -> None:
    signals.lock_released.send(
        sender=sender, key=lease.key, lease=lease, held_for=held_for, released=released
    )


def held_seconds(lease: Lease, now: datetime | None = None) -> float:
    now = now or datetime.now(timezone.utc)
    return max((now - lease.acquired_at) / timedelta(seconds=1), 0.0)
