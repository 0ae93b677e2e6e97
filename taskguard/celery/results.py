"""What a skipped run returns, and how to recognise it.

A run skipped because its key was held does not pretend to have succeeded with
``None``: its return value (and so the stored result, what ``AsyncResult.get()``
returns, and what chained callbacks receive) is a plain dict::

    {
        "__taskguard__": "skipped",
        "task": "app.tasks.fetch_feed",
        "task_id": "6f1c…",          # the skipped submission
        "key": "feed:https://…",
        "phase": "run",              # "run": refused by the worker; "queue": at .delay()
        "holder": {...} | None,      # LockInfo.to_dict() of the holder, if it could be read
    }

It is a plain dict so it survives any result serializer. Test with
:func:`is_skipped` (on the value, or on the ``AsyncResult`` of a finished task);
the Celery state of such a result is ``SUCCESS``.

A submission answered at enqueue (skipped, or merged into a pending run) is
:func:`answered`: outside a canvas nothing is published; inside one (a chord or
group member, a chain link, a task with link callbacks) the message is published
anyway, carrying its marker, and the worker returns the marker without running the
body: the chord counts it, the chain passes it on, and nothing waits for a task
that was never sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery import states as celery_states
from celery.result import AsyncResult, EagerResult

from taskguard.celery.header import HEADER, Header
from taskguard.exceptions import InvalidArgument
from taskguard.lease import LockInfo

__all__ = [
    "CANVAS_OPTIONS",
    "MARKER",
    "SKIPPED",
    "answered",
    "has_marker",
    "in_canvas",
    "is_marker",
    "is_skipped",
    "marker_in_hand",
    "skipped_result",
]

log = logging.getLogger("taskguard.celery")

#: The dict key that marks taskguard's own result values.
MARKER = "__taskguard__"
#: ``value[MARKER]`` of a skipped run.
SKIPPED = "skipped"
#: ``apply_async`` options that make a message part of a canvas: something waits
#: for its result or is published after it.
CANVAS_OPTIONS = ("chord", "group_id", "chain", "link", "link_error")


def skipped_result(
    *, task: str, task_id: str | None, key: str, phase: str, holder: LockInfo | None
) -> dict[str, Any]:
    """The return value of a skipped run (see the module docstring)."""
    return {
        MARKER: SKIPPED,
        "task": task,
        "task_id": task_id,
        "key": key,
        "phase": phase,
        "holder": holder.to_dict() if holder is not None else None,
    }


def is_skipped(value: object) -> bool:
    """Whether ``value`` is the result of a run skipped because its lock was held:
    a task's return value, ``AsyncResult.get()``, or the ``AsyncResult`` itself
    (what ``.delay()`` returns) once the task has finished. An ``AsyncResult`` of a
    task still queued or running cannot tell yet: :class:`~taskguard.InvalidArgument`
    says so (``is_skipped(result.get())`` waits for it)."""
    return has_marker(value, SKIPPED, "is_skipped")


def has_marker(value: object, kind: str, check: str) -> bool:
    """Whether ``value`` (a value, or a finished task's ``AsyncResult``) is the
    ``kind`` marker; ``check`` names the public function in the error."""
    if isinstance(value, AsyncResult):
        try:
            state = str(value.state)
        except NotImplementedError:  # no result backend: nothing to read
            state = "unknown: the app has no result backend"
        if state not in celery_states.READY_STATES:
            raise InvalidArgument(
                f"{check}(): task {value.id} has not finished (state {state}), so "
                f"whether it was {kind} is not known yet; pass result.get() to wait for it",
                "value",
                value,
            )
        value = value.result
    return isinstance(value, dict) and value.get(MARKER) == kind


def is_marker(value: object) -> bool:
    """Whether ``value`` is one of taskguard's markers (skipped, coalesced)."""
    return isinstance(value, dict) and isinstance(value.get(MARKER), str)


def in_canvas(options: Mapping[str, Any]) -> bool:
    """Whether a message published with ``options`` is part of a canvas."""
    return any(options.get(name) for name in CANVAS_OPTIONS)


def answered(
    task: Any,
    send: Callable[..., Any],
    key: str,
    task_id: str,
    value: dict[str, Any],
    args: Any,
    kwargs: Any,
    headers: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    """What ``apply_async`` returns for a submission answered at enqueue with the
    marker ``value`` (see the module docstring); ``send`` is Celery's own publish."""
    if not in_canvas(options):
        return marker_in_hand(task, task_id, value, options)
    headers[HEADER] = Header(key, marker=value).to_message()
    return send(args, kwargs, task_id, headers, options)


def marker_in_hand(task: Any, task_id: str, value: dict[str, Any], options: Any) -> EagerResult:
    """What ``.delay()`` returns for a submission answered at enqueue (skipped, or
    merged into a pending run): an EagerResult holding ``value``, also stored in the
    result backend (where results are kept) so ``AsyncResult(task_id)`` finds it."""
    conf = task._get_app().conf
    if not options.get("ignore_result", task.ignore_result) and (
        not conf.task_always_eager or conf.task_store_eager_result
    ):
        try:
            task.backend.store_result(task_id, value, celery_states.SUCCESS)
        except Exception as exc:  # the caller still gets the marker in hand
            log.warning("could not store the %s result of %s: %s", value[MARKER], task_id, exc)
    return EagerResult(task_id, value, celery_states.SUCCESS, name=task.name)
