"""A task's leases: taken, described and given back on its behalf, handed to the
worker in a message, and the record a finished run leaves.

One attempt reads the holder with the same call that found the conflict
(:meth:`TaskGuard.try_acquire`); a release never raises (the lease then ends by
expiry); every release of a run's lease is announced with
:data:`taskguard.signals.lock_released`. A lease published in a message is given
back if the publish fails (:func:`publish_carrying`).

Finished task ids: a copy of a message whose run already finished is dropped.
Brokers deliver a message again when they think it was not handled: Redis and
SQS after their visibility timeout (also while the first copy still runs),
RabbitMQ when a connection drops before the ack. Celery's own de-duplication
only looks at messages flagged ``redelivered`` and only where results persist.
So a guarded run that finishes (returns, fails for good, is rejected without
requeue, or raises ``Ignore``) records its task id in the lock table, and a
later copy of the same id finds that record once it holds the key and is
dropped: one log line, :data:`taskguard.signals.late_copy_dropped`, and Celery's
``Ignore`` (no result is stored, so the first run's result stays).

The record is a row of ``task_locks`` under the reserved key
``taskguard:finished:<task id>``, leased for ``taskguard_finished_retention``
seconds; the reaper deletes it like any other expired row. No schema change.
It costs no statement of its own: the run's acquire is refused while the record
is held (``TaskGuard.try_acquire(unless=...)``, inside the acquire statement on
PostgreSQL and SQLite), and the run's release takes it (``marker=``, the same
statement on PostgreSQL).
A retention of 0 turns the records (and this protection) off.
A run that never finished (its worker was killed) leaves no record: its message
may run again, as it always could.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry

from taskguard import signals
from taskguard.celery.message import Header, Submission, stored_task_id
from taskguard.companions import FINISHED_PREFIX
from taskguard.config import setting
from taskguard.exceptions import TaskGuardError
from taskguard.guard import ATTEMPTS_WHEN_FREED, TaskGuard
from taskguard.keys import MAX_TTL, normalize_key, validate_ttl
from taskguard.lease import Holder, Lease, LockInfo, Marker

__all__ = [
    "acquire_or_holder",
    "clamp_ttl",
    "drop_late_copy",
    "finished_key",
    "held_seconds",
    "is_finished",
    "lease_from_info",
    "outcome_is_final",
    "publish_carrying",
    "record_finished",
    "release_quietly",
    "retention",
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
        attempt = guard.take(key, ttl, holder)
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


# -- finished task ids ---------------------------------------------------------------------


def finished_key(stored_id: str | None) -> str:
    """The key of the record that the task id stored as ``stored_id`` finished."""
    return normalize_key(f"{FINISHED_PREFIX}{stored_id}")


def is_finished(guard: TaskGuard, task_id: str) -> bool:
    """Whether a run of ``task_id`` finished within the retention window."""
    info = guard.get(finished_key(stored_task_id(task_id)))
    return info is not None and info.held


def outcome_is_final(exc: BaseException | None, task: Any) -> bool:
    """Whether a run that ended with ``exc`` (None: it returned) is done for good."""
    if exc is None or isinstance(exc, Ignore):
        return True
    if isinstance(exc, Retry):
        return False
    if isinstance(exc, Reject):
        return not exc.requeue
    if not isinstance(exc, Exception):
        return False  # SystemExit (shutdown, hard time limit): the message may come back
    # A failure Celery does not ack (acks_late without acks_on_failure_or_timeout)
    # is meant to be delivered again.
    acks_late = bool(getattr(task, "acks_late", False))
    acks_on_failure = getattr(task, "acks_on_failure_or_timeout", True)
    return not (acks_late and acks_on_failure is False)


def retention(task: Any) -> float:
    """``taskguard_finished_retention`` of the task's app in seconds (0: records are
    off), read once per task object (settings are read once per process)."""
    cached = task.__dict__.get("_taskguard_finished_retention")
    if cached is None:
        value = setting(task._get_app(), "taskguard_finished_retention")
        cached = (
            0.0 if value in (0, None) else validate_ttl(value, name="taskguard_finished_retention")
        )
        task.__dict__["_taskguard_finished_retention"] = cached
    return float(cached)


def record_finished(guard: TaskGuard, task: Any, request: Any) -> None:
    """Record that ``request.id`` finished (never raises: a failure is logged and
    only this protection is lost)."""
    try:
        guard.try_acquire(
            finished_key(stored_task_id(request.id)),
            retention(task),
            task_name=task.name,
            task_id=stored_task_id(request.id),
            hostname=request.hostname,
        )
    except Exception as exc:
        log.warning("could not record that %s[%s] finished: %s", task.name, request.id, exc)


def drop_late_copy(task: Any, request: Any, key: str) -> NoReturn:
    """Log, signal and drop a copy of a task id that already finished."""
    log.warning(
        "dropped a late copy of finished %s[%s] (lock %r): a run of this task id already finished",
        task.name,
        request.id,
        key,
    )
    signals.late_copy_dropped.send(sender=task, key=key, task_id=request.id)
    raise Ignore()
