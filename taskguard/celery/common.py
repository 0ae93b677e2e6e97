"""Small pieces shared by the enqueue side, the run side and the worker hooks."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from taskguard import signals
from taskguard.config import setting
from taskguard.exceptions import TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.keys import MAX_TTL, normalize_key, validate_ttl
from taskguard.lease import Lease, LockInfo

__all__ = [
    "HEADER",
    "claim_key",
    "describe_holder",
    "header_of",
    "lease_from_info",
    "publish_delay",
    "release_quietly",
    "retry_delay",
]

log = logging.getLogger("taskguard.celery")

#: The message header taskguard's state travels in: ``{"v": 1, "key": ...,
#: "lease": Lease.to_dict() (a lease handed to the worker), "via": "enqueue"|"retry",
#: "deferred": True (published late by on_conflict="retry" at enqueue)}``.
HEADER = "taskguard"

#: Shortest countdown for a conflict retry when the holder's lease ends sooner.
MIN_RETRY_COUNTDOWN = 0.5


def header_of(request: Any) -> dict[str, Any]:
    """taskguard's header from a Celery request/context (worker: an attribute;
    eager ``apply()``: inside ``request.headers``) or a request dict, or ``{}``."""
    if isinstance(request, Mapping):
        value, headers = request.get(HEADER), request.get("headers")
    else:
        value, headers = getattr(request, HEADER, None), getattr(request, "headers", None)
    if not isinstance(value, Mapping) and isinstance(headers, Mapping):
        value = headers.get(HEADER)
    return dict(value) if isinstance(value, Mapping) else {}


def claim_key(key: str, task_id: str) -> str:
    """Companion row marking which delivery of ``task_id`` runs a handed-over lease,
    so a second delivery of the same message cannot adopt it too."""
    return normalize_key(f"{key}#run:{task_id}")


def default_ttl(app: Any, ttl: float | None) -> float:
    if ttl is not None:
        return ttl
    return validate_ttl(setting(app, "taskguard_default_ttl"), name="taskguard_default_ttl")


def clamp_ttl(seconds: float) -> float:
    return min(MAX_TTL, max(seconds, 0.001))


def _as_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def publish_delay(options: Mapping[str, Any]) -> float:
    """Seconds until a message published with these options may start."""
    countdown = options.get("countdown")
    if countdown:
        return max(0.0, float(countdown))
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if isinstance(eta, datetime):
        return max(0.0, (_as_utc(eta) - datetime.now(timezone.utc)).total_seconds())
    return 0.0


def retry_delay(countdown: Any, eta: Any, default: Any) -> float:
    """The delay ``Task.retry`` will use, for sizing the lease kept across it."""
    if eta is not None:
        return publish_delay({"eta": eta})
    if countdown is None:
        countdown = default
    return max(0.0, float(countdown or 0))


def conflict_countdown(configured: float | None, holder: LockInfo | None) -> float:
    """Countdown for a conflict retry: the configured one, else the time left on
    the holder's lease, plus jitter so waiting duplicates do not all retry at once."""
    if configured is not None:
        return configured
    left = holder.expires_in.total_seconds() if holder is not None else 0.0
    return max(MIN_RETRY_COUNTDOWN, left) * random.uniform(1.0, 1.2)


def describe_holder(holder: LockInfo | None) -> str:
    return (
        holder.describe()
        if holder is not None
        else "a holder that released before it could be read"
    )


def live_holder(guard: TaskGuard, key: str) -> LockInfo | None:
    """A live holder of ``key`` (the one whose lease ends first, under a limit)."""
    live = [info for info in guard.get_all(key) if info.held]
    return min(live, key=lambda info: info.expires_at) if live else None


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


def release_quietly(guard: TaskGuard, lease: Lease) -> bool:
    """Release without raising (a failure is logged; the lease then ends by expiry)."""
    try:
        return guard.release(lease)
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


def acquire_or_holder(
    guard: TaskGuard, key: str, ttl: float, **holder_details: Any
) -> tuple[Lease | None, LockInfo | None]:
    """``(lease, None)``, or ``(None, holder)`` when the key is held. Retries when
    the holder released between our attempt and our read of it; the holder is
    ``None`` only if that kept happening."""
    for _ in range(3):
        lease = guard.acquire(key, ttl, **holder_details)
        if lease is not None:
            return lease, None
        holder = live_holder(guard, key)
        if holder is not None:
            return None, holder
    return None, None
