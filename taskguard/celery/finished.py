"""Finished task ids: a copy of a message whose run already finished is dropped.

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
from typing import Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry

from taskguard import signals
from taskguard.celery.message import stored_task_id
from taskguard.companions import FINISHED_PREFIX
from taskguard.config import setting
from taskguard.guard import TaskGuard
from taskguard.validation import normalize_key, validate_ttl

__all__ = [
    "drop_late_copy",
    "finished_key",
    "is_finished",
    "outcome_is_final",
    "record_finished",
    "retention",
]

log = logging.getLogger("taskguard.celery")


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
