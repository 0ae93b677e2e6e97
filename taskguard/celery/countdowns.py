"""How long to wait: publish delays, retry delays and conflict countdowns."""

from __future__ import annotations

import random
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from taskguard.lease import LockInfo

__all__ = [
    "FIRST_POLL",
    "MAX_POLL",
    "MIN_RETRY_COUNTDOWN",
    "conflict_countdown",
    "poll_countdown",
    "publish_delay",
    "retry_delay",
]

#: Shortest countdown for a conflict retry when the holder's lease ends sooner.
MIN_RETRY_COUNTDOWN = 0.5
#: First and longest countdown (seconds) of a deferred start re-checking a busy key.
FIRST_POLL = 0.25
MAX_POLL = 1.0


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


def poll_countdown(polls: int, holder: LockInfo | None) -> float:
    """Countdown of a start deferred while the key is busy (a pending run, a rate=
    start), its ``polls``-th time: from :data:`FIRST_POLL`, doubling up to
    :data:`MAX_POLL`, never past the holder's expiry, at least 0.05 s."""
    countdown = min(MAX_POLL, FIRST_POLL * 2.0**polls)
    if holder is not None:
        countdown = min(countdown, max(holder.expires_in.total_seconds(), 0.0) + 0.05)
    return max(countdown, 0.05)
