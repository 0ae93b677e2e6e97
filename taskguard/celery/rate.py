"""Per-key start rates: ``rate="N/period"`` (at most N runs *started* per key in
any sliding window of ``period``, judged by the database clock).

It is the throttle window (``min_hold``) of a concurrency limit, on a companion
key: each start takes one of the N slot rows of ``<key>#rate`` with
``min_hold=period`` and releases it at once; the released row stays taken until
``acquired_at + period``. So starts are limited and concurrency is not (the run's
own lock is the task's key, as without a rate). ``min_hold=S`` on the task's own
key is the same statement with N = 1 that also keeps runs apart. A start over the
rate is deferred (published again with a countdown until the first slot frees),
never dropped; so is, unless ``on_conflict`` is given, a start that finds the key
itself held (``GuardOptions.defer_busy``: re-checked like a pending run).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from taskguard.celery.conflicts import Strategy
from taskguard.celery.deferral import defer, poll_countdown
from taskguard.celery.leasing import acquire_or_holder, release_quietly
from taskguard.celery.message import stored_task_id
from taskguard.companions import companion_key
from taskguard.exceptions import ConfigurationError
from taskguard.guard import TaskGuard
from taskguard.keys import MAX_LIMIT, MAX_TTL
from taskguard.lease import LockInfo, describe_holder

__all__ = ["BUSY", "RATE_FORMS", "Rate", "parse_rate", "rate_key", "take_start"]

#: What the error message shows as accepted.
RATE_FORMS = (
    "'N/s', 'N/m', 'N/h', 'N/d' or 'N/<number><unit>' such as '3/2s' or '10/15m' "
    f"(N from 1 to {MAX_LIMIT}), or a tuple (N, seconds)"
)
log = logging.getLogger("taskguard.celery")

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PATTERN = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([smhd])?\s*$")


@dataclass(frozen=True)
class Rate:
    """At most ``starts`` starts per key in any window of ``period`` seconds."""

    starts: int
    period: float

    def __str__(self) -> str:
        return f"{self.starts}/{self.period:g}s"


def check_rate(task: str, values: Mapping[str, Any]) -> None:
    """The lock phases ``rate=`` works with (declaration time)."""
    if values["rate"] is not None and values["lock"] == "queue":
        raise ConfigurationError(
            f"task {task}: rate= counts starts under the run's lock, so it needs "
            "lock='run' or lock='queue_and_run'"
        )


def parse_rate(task: str, value: object) -> Rate | None:
    """``rate=`` as a :class:`Rate` (``None`` stays ``None``); a one-line
    :class:`ConfigurationError` naming the task and the accepted forms otherwise."""
    if value is None or isinstance(value, Rate):
        return value
    starts: object
    period: object
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None or (match.group(2) is None and match.group(3) is None):
            raise _bad(task, value)
        starts = int(match.group(1))
        period = float(match.group(2) or 1) * _UNITS[match.group(3) or "s"]
    elif isinstance(value, tuple) and len(value) == 2:
        starts, period = value
        if isinstance(period, timedelta):
            period = period.total_seconds()
    else:
        raise _bad(task, value)
    if (
        isinstance(starts, bool)
        or not isinstance(starts, int)
        or not 1 <= starts <= MAX_LIMIT
        or isinstance(period, bool)
        or not isinstance(period, (int, float))
        or not math.isfinite(period)
        or not 0 < period <= MAX_TTL
    ):
        raise _bad(task, value)
    return Rate(starts, float(period))


def _bad(task: str, value: object) -> ConfigurationError:
    return ConfigurationError(f"task {task}: rate={value!r} is not one of {RATE_FORMS}")


def rate_key(key: str) -> str:
    """The companion key whose slot rows count ``key``'s starts."""
    return companion_key(key, "rate")


def take_start(
    task: Any, guard: TaskGuard, request: Any, key: str, rate: Rate
) -> tuple[bool, LockInfo | None]:
    """Count one start of ``key``: ``(True, None)``, or ``(False, holder)`` when
    ``rate.starts`` runs started within the last ``rate.period`` (``holder`` is the
    slot that frees first)."""
    lease, holder = acquire_or_holder(
        guard,
        rate_key(key),
        rate.period,  # a crash before the release below still ends at the window
        limit=rate.starts,
        min_hold=rate.period,
        task_name=task.name,
        task_id=stored_task_id(request.id),
        hostname=request.hostname,
    )
    if lease is None:
        return False, holder
    release_quietly(guard, lease)  # the row stays taken until acquired_at + period
    return True, None


class _WaitTurn(Strategy):
    """``rate=`` without ``on_conflict``: a start that finds the run's lock held waits
    its turn (published again, polling like a pending run: never dropped, as a start
    over the rate is not). Chosen by the options, not an ``on_conflict`` value."""

    name = run_action = "defer"

    def at_run(self, run: Any, holder: LockInfo | None, waited: float | None) -> Any:
        task, request, key = run.task, run.request, run.key
        described = describe_holder(holder)
        log.info("%s[%s] waits: lock %r is held by %s", task.name, request.id, key, described)
        polls = run.header.polls
        countdown = poll_countdown(polls, holder)
        raise defer(task, request, key, countdown, "busy", {"polls": polls + 1})


#: The strategy of a task with ``rate=`` and no ``on_conflict`` (``options.defer_busy``).
BUSY = _WaitTurn()
