"""A task's leases: taken and given back on its behalf, and handed to the worker
in a message.

One attempt reads the holder with the same call that found the conflict
(:meth:`TaskGuard.try_acquire`); a release never raises (the core's
:func:`taskguard.runs.release_quietly`: the lease then ends by expiry); every release
of a lease a run held is announced with :data:`taskguard.signals.lock_released`. A
lease published in a message is given back if the publish fails
(:func:`publish_carrying`).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

from taskguard import signals
from taskguard.celery.message import Header, Submission
from taskguard.guard import ATTEMPTS_WHEN_FREED, TaskGuard
from taskguard.lease import Holder, Lease, LockInfo
from taskguard.runs import release_quietly
from taskguard.validation import MAX_TTL

__all__ = [
    "acquire_or_holder",
    "clamp_ttl",
    "held_seconds",
    "lease_from_info",
    "publish_carrying",
    "release_quietly",
    "send_released",
]

log = logging.getLogger("taskguard.celery")


def clamp_ttl(seconds: float) -> float:
    return min(MAX_TTL, max(seconds, 0.001))


def acquire_or_holder(
    guard: TaskGuard, key: str, ttl: float, holder: Holder | None = None, **details: Any
) -> tuple[Lease | None, LockInfo | None]:
    """``(lease, None)``, or ``(None, holder)`` when the key is held, with the holder
    read by the same :meth:`TaskGuard.try_acquire` call (``details``: its keyword
    arguments); given a complete ``holder`` instead (and ``key``, ``ttl`` in stored
    form), by one :meth:`TaskGuard.take`, which validates nothing again. A conflict
    whose holder released before it could be read is tried again (the key is likely
    free now), as :meth:`TaskGuard.take` does."""
    if holder is not None:
        attempt = guard.take(key, ttl, holder, **details)
        return attempt.lease, attempt.holder
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


def send_released(sender: Any, lease: Lease, released: bool, held_for: float) -> None:
    if signals.lock_released.receivers:
        signals.lock_released.send(
            sender=sender, key=lease.key, lease=lease, held_for=held_for, released=released
        )


def held_seconds(lease: Lease, now: datetime | None = None) -> float:
    now = now or datetime.now(timezone.utc)
    return max((now - lease.acquired_at) / timedelta(seconds=1), 0.0)


def publish_carrying(
    sub: Submission, header: Header, lease: Lease | None, *, announce: bool = False
) -> Any:
    """Publish ``sub`` carrying ``header``, which hands ``lease`` to the worker. A
    publish that fails gives ``lease`` back (nothing was published: it must not wait
    for a worker), sending :data:`~taskguard.signals.lock_released` if ``announce``."""
    try:
        return sub.publish(header)
    except BaseException:
        if lease is not None and not sub.task._get_app().conf.task_always_eager:
            released = release_quietly(sub.guard, lease)
            if announce:
                send_released(sub.task, lease, released, held_seconds(lease))
        raise
