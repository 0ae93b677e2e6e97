"""The enqueue side of a guarded task: what :meth:`GuardedTask.apply_async` does.

The key is derived once and put in the message header. With a queue phase
(``lock="queue"``/``"queue_and_run"``) the lease is taken before publishing and
handed to the worker in the header; a conflict is acted on per ``on_conflict``.

Inside a canvas (a chord or group member, a chain link, a task with link
callbacks) a skipped member is still published, carrying its skipped marker (see
:func:`taskguard.celery.results.answered`); so is a coalesced one (merged into a
pending run). ``on_conflict="existing"`` has no result to hand a canvas and behaves
the same as ``"skip"``;
``"raise"`` raises :class:`AlreadyLocked` from ``apply_async`` (the canvas fails
at once); ``"retry"`` publishes the member deferred, as outside a canvas.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery.utils import uuid

from taskguard import signals
from taskguard.celery import debounce, pending
from taskguard.celery.countdowns import conflict_countdown, publish_delay
from taskguard.celery.header import HEADER
from taskguard.celery.leasing import (
    acquire_or_holder,
    clamp_ttl,
    describe_holder,
    held_seconds,
    release_quietly,
    send_released,
)
from taskguard.celery.results import answered, in_canvas, skipped_result
from taskguard.celery.taskids import is_shortened, stored_task_id
from taskguard.config import guard_for
from taskguard.exceptions import AlreadyLocked
from taskguard.lease import LockInfo

__all__ = ["publish"]

log = logging.getLogger("taskguard.celery")

#: ``send(args, kwargs, task_id, headers, options)``: Celery's own apply_async.
Send = Callable[[Any, Any, Any, dict[str, Any], dict[str, Any]], Any]


def publish(
    task: Any, send: Send, args: Any, kwargs: Any, task_id: Any, options: dict[str, Any]
) -> Any:
    """Publish like :meth:`celery.Task.apply_async`, with taskguard's header."""
    opts = task.taskguard_options
    headers = dict(options.pop("headers", None) or {})
    incoming = headers.get(HEADER)
    if isinstance(incoming, Mapping) and incoming.get("via") == "retry":
        # Published by GuardedTask.retry(): carries its own lease (or none).
        return send(args, kwargs, task_id, headers, options)
    key = opts.deriver.derive(args, kwargs)
    header: dict[str, Any] = {"v": 1, "key": key, "via": "enqueue"}
    if opts.debounce is not None:  # [debounce] publish late, replacing the pending run
        return debounce.publish_debounced(task, send, key, args, kwargs, task_id, headers, options)
    if opts.on_conflict == "coalesce":  # [coalesce] publish as the pending run, or merge
        return pending.publish_coalesced(task, send, key, args, kwargs, task_id, headers, options)
    if not opts.locks_queue:
        headers[HEADER] = header
        return send(args, kwargs, task_id, headers, options)

    task_id = task_id or uuid()
    guard = guard_for(task._get_app())
    ttl = clamp_ttl(task._queue_ttl() + publish_delay(options))
    lease, holder = acquire_or_holder(
        guard,
        key,
        ttl,
        task_name=task.name,
        task_id=stored_task_id(task_id),
        **opts.acquire_options,
    )
    if lease is None:
        return _conflict(task, send, key, holder, task_id, args, kwargs, headers, options)
    signals.lock_acquired.send(sender=task, key=key, lease=lease)
    header["lease"] = lease.to_dict()
    headers[HEADER] = header
    try:
        return send(args, kwargs, task_id, headers, options)
    except BaseException:
        if not task._get_app().conf.task_always_eager:
            # Nothing was published: the lease must not wait for a worker.
            released = release_quietly(guard, lease)
            send_released(task, lease, released, held_seconds(lease))
        raise


def _conflict(
    task: Any,
    send: Send,
    key: str,
    holder: LockInfo | None,
    task_id: str,
    args: Any,
    kwargs: Any,
    headers: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    strategy = task.taskguard_options.on_conflict
    holder_task = holder.holder.task_id if holder is not None else None
    if strategy == "existing" and (holder_task is None or is_shortened(holder_task)):
        strategy = "skip"  # no task to point at (e.g. taken with guard.lock())
    canvas = in_canvas(options)
    signals.lock_conflict.send(sender=task, key=key, holder=holder, action=strategy)
    described = describe_holder(holder)
    if strategy == "raise":
        log.warning("refused %s[%s]: lock %r is held by %s", task.name, task_id, key, described)
        raise AlreadyLocked(key, holder)
    if strategy == "existing" and not canvas:
        log.warning(
            "not publishing %s: lock %r is held by %s; returning its result",
            task.name,
            key,
            described,
        )
        return task.AsyncResult(holder_task)
    if strategy == "retry":
        countdown = conflict_countdown(task.taskguard_options.retry_countdown, holder)
        log.warning(
            "deferring %s[%s] by %.1fs: lock %r is held by %s",
            task.name,
            task_id,
            countdown,
            key,
            described,
        )
        headers[HEADER] = {"v": 1, "key": key, "via": "enqueue", "deferred": True}
        options.pop("eta", None)
        options["countdown"] = countdown
        return send(args, kwargs, task_id, headers, options)
    value = skipped_result(task=task.name, task_id=task_id, key=key, phase="queue", holder=holder)
    log.warning(
        "skipped %s[%s]: lock %r is held by %s%s",
        task.name,
        task_id,
        key,
        described,
        "; publishing its skipped marker for the canvas" if canvas else "",
    )
    return answered(task, send, key, task_id, value, args, kwargs, headers, options)
