"""``debounce=S`` (with ``debounce_max=T``): one run, S seconds after the last
submission for the key, with the last submission's arguments; under a steady
stream of submissions it still runs at least once per T.

It is ``on_conflict="coalesce"`` with ``coalesce_replace=True`` and a countdown
(see :mod:`taskguard.celery.pending`): every submission takes the task's pending
place on the key (``<key>#pending:<task name>``) from the one before and is
published ``S`` seconds late; a message that finds the place taken by a newer submission returns the
``coalesced`` marker naming it, without running. The cap: the first submission
after a run takes ``<key>#debounce:<task name>`` (the *batch*; its grant time is the batch's
start by the database clock); a submission's countdown is cut to what is left of
``T`` since then. Every submission of a batch is thus due by the batch's deadline,
so the newest one (which holds the pending place) runs by then, with the newest
arguments; one submitted after the deadline, while the batch has not run yet, is
due at once. Every run ends the batch (the next submission starts one).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery.utils import uuid

from taskguard.celery import pending
from taskguard.celery.header import HEADER, Header, stored_task_id
from taskguard.celery.leasing import (
    acquire_or_holder,
    clamp_ttl,
    lease_from_info,
    release_quietly,
)
from taskguard.companions import companion_key
from taskguard.config import guard_for
from taskguard.guard import TaskGuard
from taskguard.lease import Lease

__all__ = ["batch_key", "publish_debounced", "started"]


def batch_key(key: str, task_name: str) -> str:
    """The companion key whose row marks the start of the task's current batch on ``key``."""
    return companion_key(key, "debounce", task_name)


def publish_debounced(
    task: Any,
    send: Any,
    key: str,
    args: Any,
    kwargs: Any,
    task_id: Any,
    headers: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    """Publish ``debounce`` seconds late as the key's pending run (replacing the one
    there is), or earlier when the batch's ``debounce_max`` ends sooner."""
    opts = task.taskguard_options
    task_id = task_id or uuid()
    guard = guard_for(task._get_app())
    queue_ttl = task._queue_ttl()
    countdown = float(opts.debounce)
    batch_dict = None
    if opts.debounce_max is not None:
        cap = float(opts.debounce_max)
        details = {"task_name": task.name, "task_id": stored_task_id(task_id)}
        batch, info = acquire_or_holder(
            guard, batch_key(key, task.name), clamp_ttl(cap + queue_ttl), **details
        )
        left = cap
        if batch is None and info is not None:
            deadline = info.acquired_at + timedelta(seconds=cap)
            left = (deadline - info.read_at).total_seconds()
            batch = lease_from_info(info)
        countdown = max(0.0, min(countdown, left))
        if batch is not None:
            batch_dict = {"batch": batch.to_dict()}
    lease, holder = pending.take_place(
        task, guard, key, task_id, clamp_ttl(countdown + queue_ttl), replace=True
    )
    if lease is None and holder is not None:  # lost three races to newer submissions
        return pending.merged(task, send, key, task_id, holder, args, kwargs, headers, options)
    pending_dict = lease.to_dict() if lease is not None else None
    headers[HEADER] = Header(key, pending=pending_dict, debounce=batch_dict).to_message()
    options.pop("eta", None)
    options["countdown"] = countdown
    try:
        return send(args, kwargs, task_id, headers, options)
    except BaseException:
        if lease is not None and not task._get_app().conf.task_always_eager:
            release_quietly(guard, lease)
        raise


def started(guard: TaskGuard, header: Header) -> None:
    """A debounced run starts: its batch ends (the next submission starts one)."""
    value = header.debounce
    if value is None or not isinstance(value.get("batch"), dict):
        return
    try:
        batch = Lease.from_dict(value["batch"])
    except (KeyError, TypeError, ValueError):
        return
    release_quietly(guard, batch)  # by owner: a newer batch is never ended
