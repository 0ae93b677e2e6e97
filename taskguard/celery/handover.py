"""The queue phase (``lock="queue"``/``"queue_and_run"``) and leases handed over in a
message (publisher -> worker, run -> retry).

At enqueue (:func:`publish`) the lease is taken before publishing and
carried in the message header; a conflict is acted on by the task's
``on_conflict`` strategy; a publish that fails gives the lease back. In the worker
``lock="queue"`` ends the carried lease as the run starts
(:func:`start_queue_phase`) and ``queue_and_run`` (or a retry) takes it over
(:func:`take_over`).


The message header holds the lease in a compact form (one string: its owner id, slot,
throttle window, token and times; :func:`taskguard.celery.message.carry`); a dict
header from a version before it is still read. The worker adopts it with
``TaskGuard.take_over`` (``adopt(..., exclusive=True)`` validating nothing again): the
same row and fencing token, renewed to the run's ttl, so there is no moment in which
the key is free, and in
the same statement passed to an owner id of this run's own, with this pool
process as its holder. A second delivery of the same message (a broker redelivery
while the first copy runs) then finds the owner id it carries gone and the key
held by its own task id: a conflict with itself, retried until that run ends. A
hand-over that lapsed (the lease expired while the message waited) falls back to a
fresh acquisition.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from taskguard import signals
from taskguard.celery.lease_calls import (
    acquire_or_holder,
    held_seconds,
    publish_carrying,
    release_quietly,
    send_released,
)
from taskguard.celery.message import Handed, Header, Submission, carry, stored_task_id
from taskguard.guard import TaskGuard
from taskguard.lease import Holder, Lease, LockInfo
from taskguard.options import Phase

__all__ = ["publish", "start_queue_phase", "take_over"]

log = logging.getLogger("taskguard.celery")


def start_queue_phase(
    task: Any, guard: TaskGuard, request: Any, key: str, header: Header
) -> tuple[bool, bool, LockInfo | None]:
    """lock="queue" at start: give back the lease carried in the message; a
    deferred message (on_conflict="retry" at enqueue) checks the key is free.
    Returns (first, blocked, holder); ``first``: this call ended the carried lease,
    so no other delivery of the message started before it."""
    if header.lease is not None:
        lease = Handed.of(header.lease).lease(key)
        released = release_quietly(guard, lease)
        send_released(task, lease, released, held_seconds(lease))
        return released, False, None
    if not header.deferred:
        return False, False, None
    limit = task.taskguard_options.limit
    # No min_hold here: releasing a probe must not start a throttle window.
    probe, holder = acquire_or_holder(
        guard,
        key,
        task._ttl(),
        task_name=task.name,
        task_id=stored_task_id(request.id),
        hostname=request.hostname,
        **({"limit": limit} if limit != 1 else {}),
    )
    if probe is None:
        return False, True, holder
    release_quietly(guard, probe)
    return False, False, None


def take_over(
    task: Any, guard: TaskGuard, request: Any, key: str, carried: str | dict[str, Any], ttl: float
) -> tuple[Lease | None, bool, LockInfo | None]:
    """Adopt the lease carried in the message: (lease, False, None); or (None, True,
    holder) when another delivery of this task id has it; or (None, False, None) when
    the hand-over lapsed (it expired while queued). One statement when it is adopted."""
    stored_id = stored_task_id(request.id)
    # "alternate": a copy published for an outage whose hand-over's outcome was unknown
    # (taskguard.celery.deferral.retry_later) may hold the key under either owner id.
    given = Handed.of(carried)
    holder = Holder(task.name, stored_id, request.hostname, os.getpid())
    for owner in (given.owner, given.alternate) if given.alternate else (given.owner,):
        lease = guard.take_over(key, owner, ttl, holder, given.slot, given.min_hold, Phase.RUN)
        if lease is not None:
            signals.lock_acquired.send(sender=task, key=key, lease=lease)
            return lease, False, None
    for info in guard.get_all(key):
        if info.held and info.holder.task_id == stored_id:
            return None, True, info
    log.info("hand-over of lock %r to %s[%s] lapsed; acquiring", key, task.name, request.id)
    return None, False, None


def publish(sub: Submission) -> Any:
    """A queue phase's publish: take the lease (for ``queue_ttl`` plus the countdown),
    publish it in the header; or act on the conflict per ``on_conflict``."""
    task, guard, extra = sub.task, sub.guard, sub.opts.acquire_options
    tid = stored_task_id(sub.task_id)
    if extra:  # a limit or a throttle window, validated with the holder
        details = {"task_name": task.name, "task_id": tid, "phase": Phase.QUEUE, **extra}
        lease, holder = acquire_or_holder(guard, sub.key, sub.ttl, **details)
    else:  # one lean acquire: the key, ttl and holder are in stored form already
        who = Holder(task.name, tid, guard.hostname, os.getpid())
        lease, holder = acquire_or_holder(guard, sub.key, sub.ttl, who, phase=Phase.QUEUE)
    if lease is None:
        return sub.opts.strategy.held_at_enqueue(sub, holder)
    signals.lock_acquired.send(sender=task, key=sub.key, lease=lease)
    return publish_carrying(sub, Header(sub.key, lease=carry(lease)), lease, announce=True)
