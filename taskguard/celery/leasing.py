"""Taking, describing and giving back leases on behalf of a task.

One attempt reads the holder with the same call that found the conflict
(:meth:`TaskGuard.try_acquire`); a release never raises (the lease then ends by
expiry); every release is announced with :data:`taskguard.signals.lock_released`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from taskguard import signals
from taskguard.config import setting
from taskguard.exceptions import DatabaseUnavailable, TaskGuardError
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
    "release_when_reachable",
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


def release_quietly(
    guard: TaskGuard, lease: Lease, marker: Marker | None = None, reason: str | None = None
) -> bool:
    """Release without raising (a failure is logged; the lease then ends by expiry);
    ``marker``: complete, as the Celery layer builds them (see :meth:`TaskGuard.give_back`);
    ``reason``: why, for the history (see :meth:`TaskGuard.release`)."""
    try:
        return guard.give_back(lease, marker, reason)
    except TaskGuardError as exc:
        log.error(
            "could not release lock %r (owner %s): %s; it ends by expiry at %s",
            lease.key,
            lease.owner,
            exc,
            lease.expires_at.isoformat(),
        )
        return False


#: Seconds between attempts of a release that could not reach the lock database.
RELEASE_RETRY = 2.0


def release_when_reachable(guard: TaskGuard, leases: Iterable[Lease], why: str) -> None:
    """Release ``leases`` now; those that cannot reach the lock database are tried
    again every :data:`RELEASE_RETRY` seconds in a daemon thread until released (or
    expired: then they ended by themselves). For a run that gives up because the
    database is unreachable. Never raises."""
    left = [lease for lease in leases if not _release_reached(guard, lease, why)]
    if left:
        log.warning(
            "lock(s) %s cannot be released now (%s); trying again until they expire",
            ", ".join(repr(lease.key) for lease in left),
            why,
        )
        threading.Thread(
            target=_keep_releasing, args=(guard, left, why), daemon=True, name="taskguard-release"
        ).start()


def _release_reached(guard: TaskGuard, lease: Lease, why: str) -> bool:
    """Whether the release reached the database (it ended the lease, or found it gone)."""
    try:
        if guard.release(lease):
            log.info("released lock %r (owner %s): %s", lease.key, lease.owner, why)
    except DatabaseUnavailable:  # also OutcomeUnknown: tried again
        return False
    except TaskGuardError as exc:
        log.error("could not release lock %r (owner %s): %s", lease.key, lease.owner, exc)
    return True


def _keep_releasing(guard: TaskGuard, leases: list[Lease], why: str) -> None:
    while leases:
        time.sleep(RELEASE_RETRY)
        now = datetime.now(timezone.utc)
        leases = [
            lease
            for lease in leases
            if lease.expires_at > now and not _release_reached(guard, lease, why)
        ]


def send_released(sender: Any, lease: Lease, released: bool, held_for: float) -> None:
    if signals.lock_released.receivers:
        signals.lock_released.send(
            sender=sender, key=lease.key, lease=lease, held_for=held_for, released=released
        )


def held_seconds(lease: Lease, now: datetime | None = None) -> float:
    now = now or datetime.now(timezone.utc)
    return max((now - lease.acquired_at) / timedelta(seconds=1), 0.0)
