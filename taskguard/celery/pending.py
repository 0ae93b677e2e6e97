"""Pending runs: ``on_conflict="coalesce"`` (per key at most one running and one
pending run of the task) and ``debounce=`` (a coalesced run published late).

The pending run is a lease on the companion key ``<key>#pending:<task name>``, held
by the pending submission's task id. It is the task's own: a submission only ever
merges into a pending run of the same task, so two tasks that share a key (an
importer that coalesces, a debounced reindexer) each keep their pending run, and
both still run one at a time under the key's lock.

* **enqueue**: a submission takes the pending place and is published carrying that
  lease; if another submission holds it, this one is *merged* into it: nothing is
  published and the caller gets a ``coalesced`` marker naming the pending task id
  (inside a canvas the message is published carrying the marker, see
  :meth:`Submission.answer <taskguard.celery.message.Submission.answer>`).
  With ``coalesce_replace=True`` the submission ends the pending run's row and
  takes it instead (its arguments are the newest); the replaced message, when it
  arrives, finds the row is not its own and returns the marker without running.
* **worker**: the pending message first checks the row is still its own (renewing
  it), then takes the task's key. Key free: it gives its pending place up (the
  next submission becomes the pending run) and runs. Key held: it is *deferred*
  (published again with a short countdown, no worker slot held; see
  :mod:`taskguard.celery.deferral`), keeping the row.

Why deferred messages rather than parked rows published by whoever frees the key:
the message never leaves the broker, so a SIGKILLed holder (or worker) loses
nothing: the pending message keeps re-checking and starts once the holder's lease
ends (released by the worker's main process, or expired). No message bodies are
stored in the database and nothing new must run (no beat job) for it to start.
The cost is polling: the countdown starts at 0.25 s and doubles per deferral up to
:data:`MAX_POLL` (never past the holder's expiry), so the pending run starts at
most about that long after the running one ends; one message per busy key per poll.

``debounce=S`` (with ``debounce_max=T``): one run, S seconds after the last
submission for the key, with the last submission's arguments; under a steady
stream of submissions it still runs at least once per T. It is coalesce with
``coalesce_replace=True`` and a countdown: every submission takes the task's
pending place from the one before and is published ``S`` seconds late; a message
that finds the place taken by a newer submission returns the ``coalesced`` marker
naming it, without running. The cap: the first submission after a run takes
``<key>#debounce:<task name>`` (the *batch*; its grant time is the batch's start
by the database clock); a submission's countdown is cut to what is left of ``T``
since then. Every submission of a batch is thus due by the batch's deadline, so
the newest one (which holds the pending place) runs by then, with the newest
arguments; one submitted after the deadline, while the batch has not run yet, is
due at once. Every run ends the batch (the next submission starts one).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from taskguard import signals
from taskguard.celery.deferral import defer, poll_countdown
from taskguard.celery.lease_calls import (
    acquire_or_holder,
    clamp_ttl,
    lease_from_info,
    publish_carrying,
    release_quietly,
)
from taskguard.celery.message import Header, Submission, has_marker, stored_task_id
from taskguard.companions import companion_key
from taskguard.config import guard_for
from taskguard.exceptions import TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.lease import Lease, LockInfo
from taskguard.options import Conflict
from taskguard.results import MARKER

__all__ = [
    "carried",
    "claim",
    "give_up",
    "is_coalesced",
    "merged",
    "publish_coalesced",
    "publish_debounced",
    "started",
    "wait_for_key",
]

log = logging.getLogger("taskguard.celery")


#: ``value["__taskguard__"]`` of a submission merged into the pending run.
COALESCED = "coalesced"
#: Timestamps read back may differ from the handed ones by rounding.
_SKEW = timedelta(milliseconds=1)
#: Attempts of a replacing submission racing other replacing submissions.
_REPLACE_ATTEMPTS = 3
#: How long a replaced pending message waits for its replacement to take the place.
_REPLACEMENT_WAIT = 2.0


def pending_key(key: str, task_name: str) -> str:
    """The companion key whose row names the pending run of task ``task_name`` on ``key``."""
    return companion_key(key, "pending", task_name)


def batch_key(key: str, task_name: str) -> str:
    """The companion key whose row marks the start of the task's current debounce
    batch on ``key``."""
    return companion_key(key, "debounce", task_name)


def coalesced_result(
    *, task: str, task_id: str | None, key: str, into: str | None, phase: str
) -> dict[str, Any]:
    """What a merged submission returns: a plain dict (any serializer) naming the
    pending run (``into``) that covers it."""
    return {
        MARKER: COALESCED,
        "task": task,
        "task_id": task_id,
        "key": key,
        "into": into,
        "phase": phase,
    }


def is_coalesced(value: object) -> bool:
    """Whether ``value`` is the result of a submission merged into a pending run (a
    value, or a finished task's ``AsyncResult``: as :func:`~taskguard.is_skipped`)."""
    return has_marker(value, COALESCED, "is_coalesced")


# -- enqueue ------------------------------------------------------------------------------


def publish_coalesced(sub: Submission) -> Any:
    """Publish as the key's pending run, or merge into the one there is."""
    replace = sub.task.taskguard_options.coalesce_replace
    lease, holder = take_place(sub, sub.ttl, replace=replace)
    if lease is None and holder is not None:
        return merged(sub, holder)
    header = Header(sub.key, pending=lease.to_dict() if lease is not None else None)
    return publish_carrying(sub, header, lease)


def publish_debounced(sub: Submission) -> Any:
    """Publish ``debounce`` seconds late as the key's pending run (replacing the one
    there is), or earlier when the batch's ``debounce_max`` ends sooner."""
    task, key = sub.task, sub.key
    opts = task.taskguard_options
    queue_ttl = task._queue_ttl()
    countdown = float(opts.debounce)
    batch_dict = None
    if opts.debounce_max is not None:
        cap = float(opts.debounce_max)
        details = {"task_name": task.name, "task_id": stored_task_id(sub.task_id)}
        batch, info = acquire_or_holder(
            sub.guard, batch_key(key, task.name), clamp_ttl(cap + queue_ttl), **details
        )
        left = cap
        if batch is None and info is not None:
            deadline = info.acquired_at + timedelta(seconds=cap)
            left = (deadline - info.read_at).total_seconds()
            batch = lease_from_info(info)
        countdown = max(0.0, min(countdown, left))
        if batch is not None:
            batch_dict = {"batch": batch.to_dict()}
    lease, holder = take_place(sub, clamp_ttl(countdown + queue_ttl), replace=True)
    if lease is None and holder is not None:  # lost three races to newer submissions
        return merged(sub, holder)
    sub.options.pop("eta", None)
    sub.options["countdown"] = countdown
    pending = lease.to_dict() if lease is not None else None
    return publish_carrying(sub, Header(key, pending=pending, debounce=batch_dict), lease)


def take_place(
    sub: Submission, ttl: float, *, replace: bool
) -> tuple[Lease | None, LockInfo | None]:
    """Become the key's pending run: ``(lease, None)``; or ``(None, holder)`` naming
    the pending run there is. ``replace``: end that run's place (released by its
    owner id, so a concurrent replacement is never undone) and take it."""
    task, guard, key, task_id = sub.task, sub.guard, sub.key, sub.task_id
    details = {"task_name": task.name, "task_id": stored_task_id(task_id)}
    pkey = pending_key(key, task.name)
    lease, holder = acquire_or_holder(guard, pkey, ttl, **details)
    for _ in range(_REPLACE_ATTEMPTS if replace else 0):
        if lease is not None or holder is None:
            break
        release_quietly(guard, lease_from_info(holder))
        lease, again = acquire_or_holder(guard, pkey, ttl, **details)
        if lease is not None:
            replaced = holder.holder.task_id
            log.info("%s[%s] replaces pending run %s of key %r", task.name, task_id, replaced, key)
            signals.run_coalesced.send(
                sender=task, key=key, task_id=replaced, into=task_id, replaced=True
            )
        holder = again
    return lease, holder


def merged(sub: Submission, holder: LockInfo) -> Any:
    """Merge a submission into the pending run ``holder`` names: the ``coalesced``
    marker, in an EagerResult (stored in the result backend too), or published for
    the worker to return when the submission is part of a canvas."""
    task, key, task_id = sub.task, sub.key, sub.task_id
    into = holder.holder.task_id
    log.info("merged %s[%s] into pending run %s of key %r", task.name, task_id, into, key)
    record_merge(sub.guard, task, key, task_id, into)
    signals.lock_conflict.send(sender=task, key=key, holder=holder, action=Conflict.COALESCE)
    signals.run_coalesced.send(sender=task, key=key, task_id=task_id, into=into, replaced=False)
    value = coalesced_result(task=task.name, task_id=task_id, key=key, into=into, phase="queue")
    return sub.answer(value)


def record_merge(guard: TaskGuard, task: Any, key: str, task_id: str, into: str | None) -> None:
    """The history's record of a submission merged into the pending run ``into``."""
    guard.record_event(
        key,
        "coalesced",
        f"merged into pending run {into}",
        task_name=task.name,
        task_id=stored_task_id(task_id),
    )


# -- worker ---------------------------------------------------------------------------------


def _pending_ttl(task: Any, countdown: float = 0.0) -> float:
    return clamp_ttl(countdown + task._queue_ttl())


def claim(
    task: Any, guard: TaskGuard, request: Any, key: str, header: Header
) -> tuple[Lease | None, dict[str, Any] | None]:
    """The pending lease a message carries, renewed: ``(lease, None)``; ``(None,
    marker)`` when a newer submission took the pending place (this message is
    covered by it and must not run); ``(None, None)`` without a pending lease."""
    handed = header.pending
    if handed is None:
        return None, None
    pkey = pending_key(key, task.name)
    try:
        mine = Lease.from_dict(handed)
        lease = guard.adopt(pkey, mine.owner, _pending_ttl(task), slot=mine.slot)
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring a malformed pending lease in %s[%s]: %s", task.name, request.id, exc)
        return None, None
    if lease is not None:
        return lease, None
    row = next(iter(guard.get_all(pkey)), None)
    if row is None or (row.owner == mine.owner and row.expires_at >= mine.expires_at - _SKEW):
        # Our place lapsed by itself (the message waited longer than queue_ttl),
        # not ended by a replacing submission (that ends it before its expiry):
        # take it again unless a newer submission has meanwhile.
        lease, row = acquire_or_holder(
            guard, pkey, _pending_ttl(task), task_name=task.name, task_id=stored_task_id(request.id)
        )
        if lease is not None:
            return lease, None
    # Replaced; a place released but not yet taken is a replacement in progress:
    # its new owner is read once it has taken the place, so the marker names it.
    into = _new_pending_owner(guard, pkey, mine.owner, row)
    log.info("%s[%s] is covered by pending run %s of key %r", task.name, request.id, into, key)
    return None, coalesced_result(
        task=task.name, task_id=request.id, key=key, into=into, phase="run"
    )


def _new_pending_owner(guard: TaskGuard, pkey: str, mine: str, row: LockInfo | None) -> str | None:
    """The task id of the submission that replaced ``mine`` at ``pkey``. None only
    if no one takes the place within :data:`_REPLACEMENT_WAIT` seconds."""
    deadline = time.monotonic() + _REPLACEMENT_WAIT
    while row is None or row.owner == mine:
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)
        row = next(iter(guard.get_all(pkey)), None)
    return row.holder.task_id


def give_up(task: Any, header: Header) -> None:
    """A pending run that will not run (revoked, or its pool child died) gives its
    place back, so later submissions do not merge into it. Never raises."""
    handed = header.pending
    if handed is None:
        return
    try:
        lease = Lease.from_dict(handed)
        if release_quietly(guard_for(task._get_app()), lease):
            log.info("%s gave up the pending place of %r", task.name, lease.key)
    except Exception:
        log.exception("could not give up the pending place carried by %s", task.name)


def carried(header: Header, lease: Lease | None) -> dict[str, Any]:
    """What a deferred copy of a pending run carries on: its pending lease and
    the debounce batch."""
    return {"debounce": header.debounce, "pending": lease.to_dict() if lease else None}


def started(guard: TaskGuard, lease: Lease | None, header: Header) -> None:
    """The pending run has the key: the next submission becomes the pending one; a
    debounced run's batch ends (the next submission starts one)."""
    if lease is not None:
        release_quietly(guard, lease)
    value = header.debounce
    if value is None or not isinstance(value.get("batch"), dict):
        return
    try:
        batch = Lease.from_dict(value["batch"])
    except (KeyError, TypeError, ValueError):
        return
    release_quietly(guard, batch)  # by owner: a newer batch is never ended


def wait_for_key(
    task: Any,
    guard: TaskGuard,
    request: Any,
    key: str,
    holder: LockInfo | None,
    lease: Lease | None,
    header: Header,
) -> Any:
    """The key is held: defer as the pending run (returns the Retry to raise), or,
    if another submission is pending already, return the coalesced marker."""
    if lease is None:  # a message published without the pending place (send_task, beat)
        got, other = acquire_or_holder(
            guard,
            pending_key(key, task.name),
            _pending_ttl(task),
            task_name=task.name,
            task_id=stored_task_id(request.id),
        )
        if got is None and other is not None:
            into = other.holder.task_id
            record_merge(guard, task, key, request.id, into)
            signals.lock_conflict.send(
                sender=task, key=key, holder=holder, action=Conflict.COALESCE
            )
            signals.run_coalesced.send(
                sender=task, key=key, task_id=request.id, into=into, replaced=False
            )
            return coalesced_result(
                task=task.name, task_id=request.id, key=key, into=into, phase="run"
            )
        lease = got
    polls = header.polls
    countdown = poll_countdown(polls, holder)
    if lease is not None and request.is_eager:
        # Not re-run (see taskguard.celery.deferral): later submissions must not merge
        # into a run that will not happen.
        release_quietly(guard, lease)
        lease = None
    if lease is not None:
        try:
            guard.renew(lease, _pending_ttl(task, countdown))
        except TaskGuardError as exc:  # it ends by expiry; the copy takes it again
            log.warning("could not renew pending run %s of %r: %s", request.id, key, exc)
    extra = {**carried(header, lease), "polls": polls + 1}
    if polls == 0:
        signals.lock_conflict.send(sender=task, key=key, holder=holder, action=Conflict.COALESCE)
    raise defer(task, request, key, countdown, Conflict.COALESCE, extra)
