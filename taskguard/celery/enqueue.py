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

from taskguard.celery import debounce, handoff, pending
from taskguard.celery.header import HEADER, Header

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
    if opts.debounce is not None:  # [debounce] publish late, replacing the pending run
        return debounce.publish_debounced(task, send, key, args, kwargs, task_id, headers, options)
    if opts.strategy.pending:  # [coalesce] publish as the pending run, or merge
        return pending.publish_coalesced(task, send, key, args, kwargs, task_id, headers, options)
    if not opts.locks_queue:
        headers[HEADER] = Header(key).to_message()
        return send(args, kwargs, task_id, headers, options)
    # [queue phase] take the lease, then publish it in the message

    return handoff.publish_holding(task, send, key, args, kwargs, task_id, headers, options)
