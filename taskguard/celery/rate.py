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
itself held (the core's ``Conflict.DEFER``: re-checked like a pending run). ``rate=`` itself is
parsed and checked by the core (taskguard.options).
"""

from __future__ import annotations

from typing import Any

from taskguard.celery.lease_calls import acquire_or_holder, release_quietly
from taskguard.celery.message import stored_task_id
from taskguard.companions import companion_key
from taskguard.guard import TaskGuard
from taskguard.lease import LockInfo
from taskguard.options import Rate

__all__ = ["take_start"]


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
