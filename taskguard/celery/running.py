"""The run side of a guarded task: what :meth:`GuardedTask.__call__` does for every
execution (worker or eager).

The lease is taken (or adopted from the message), renewed while the body runs,
and released in a ``finally`` so every way out (return, exception, Reject,
Ignore, soft time limit) gives it back exactly once; a ``retry()`` hands it to
the retry message instead. A copy of a task id that already finished is dropped
(see :mod:`taskguard.celery.completions`); a canvas member answered at enqueue
(skipped, coalesced) returns the marker it carries without running.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from taskguard import signals
from taskguard.celery import completions, debounce, handoff, outage, pending, rate
from taskguard.celery.countdowns import conflict_countdown, poll_countdown
from taskguard.celery.deferral import defer
from taskguard.celery.header import header_of, message_key
from taskguard.celery.interrupt import Interrupter
from taskguard.celery.leasing import (
    acquire_or_holder,
    describe_holder,
    release_quietly,
    send_released,
)
from taskguard.celery.renewal import ActiveRun, Heartbeat, enter_run, exit_run
from taskguard.celery.results import is_marker, skipped_result
from taskguard.celery.taskids import stored_task_id
from taskguard.config import guard_for, setting
from taskguard.exceptions import AlreadyLocked
from taskguard.guard import TaskGuard
from taskguard.keys import validate_ttl
from taskguard.lease import Lease, LockInfo, Marker

__all__ = ["finish", "run_guarded"]

log = logging.getLogger("taskguard.celery")


def run_guarded(task: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``task``'s body for ``request`` under its lease (see the module docstring)."""
    opts = task.taskguard_options
    header = header_of(request)
    marker = header.get("marker")
    if is_marker(marker):
        return marker  # answered at enqueue; published only so the canvas goes on
    key = message_key(opts, header, args, kwargs)
    guard = guard_for(task._get_app())
    track = completions.tracks(task, request)
    # This run's finished record: refuses the acquire, then rides on the release.
    done = completions.finished_key(request.id) if track else None
    if not opts.locks_run:
        first, blocked, holder = handoff.start_queue_phase(task, guard, request, key, header)
        # A delivery that ended the queued lease is the first of its message to
        # start: none before it ran, so there is no finished record to read.
        if track and not first and completions.is_finished(guard, request.id):
            completions.drop_late_copy(task, request, key)
        if blocked:
            return run_conflict(task, guard, request, key, holder)
        return _body(task, guard, request, None, args, kwargs, done)
    ttl = task._ttl()
    lease = None
    # [coalesce/debounce] a pending run first checks it is still the key's pending run.
    waiting = None
    if opts.pending_runs:
        waiting, covered = pending.claim(task, guard, request, key, header)
        if covered is not None:
            return covered
    handed = header.get("lease")
    if isinstance(handed, dict):
        lease, blocked, holder = handoff.take_over(task, guard, request, key, handed, ttl)
        if blocked:
            return run_conflict(task, guard, request, key, holder, own=True)
        # Adopting the hand-off took it from the owner id in the message, which no
        # delivery of this task id had taken before: none of them ran, let alone
        # finished. Otherwise the acquire below refuses a finished task id itself.
    if lease is None:
        lease, holder, waited = _acquire(task, guard, request, key, ttl, done, header)
        if lease is None:
            if track and holder is not None and holder.key == done:
                if waiting is not None:  # [coalesce/debounce] not a run that will happen
                    release_quietly(guard, waiting)
                completions.drop_late_copy(task, request, key)
            if opts.pending_runs and not _own(request, holder):  # [coalesce/debounce]
                return pending.wait_for_key(task, guard, request, key, holder, waiting, header)
            return run_conflict(task, guard, request, key, holder, waited=waited)
        signals.lock_acquired.send(sender=task, key=key, lease=lease)
    run = ActiveRun(guard, key, lease, request)
    outage.holding(request, lease)  # an outage from here to the body: the copy adopts it
    if opts.rate is not None:  # [rate] count the start, or defer it
        counted, slot = rate.take_start(task, guard, request, key, opts.rate)
        if not counted:
            finish(task, run)
            extra = pending.carried(header, waiting)
            raise defer(task, request, key, _rate_countdown(slot), "rate", extra)
    if opts.pending_runs:  # [coalesce/debounce] the next submission becomes pending
        pending.started(guard, waiting)
        debounce.started(guard, header)
    return _body(task, guard, request, run, args, kwargs, done)


def _body(
    task: Any,
    guard: TaskGuard,
    request: Any,
    run: ActiveRun | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    done: str | None,
) -> Any:
    outage.body_started(request)  # from here on an outage is the body's own error
    token = enter_run(run) if run is not None else None
    heartbeat = Heartbeat(run, task, request.id) if run is not None else None
    if run is not None and task.taskguard_options.stop_on_lease_loss:
        run.interrupter = Interrupter(task.name).arm()
    outcome: BaseException | None = None
    try:
        if heartbeat is not None:
            heartbeat.start()
        try:
            return task.run(*args, **kwargs)
        except BaseException as exc:
            outcome = exc
            raise
        finally:
            if run is not None and run.interrupter is not None:
                run.interrupter.disarm()  # first: nothing may interrupt the clean-up
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if token is not None:
            exit_run(token)
        final = done is not None and completions.outcome_is_final(outcome, task)
        if run is not None and not run.handed_over:
            # The finished record goes with the release (one statement on PostgreSQL).
            finish(task, run, completions.marker(task, request, done) if final else None)
        else:
            if final:
                completions.record_finished(guard, task, request)
            if run is not None:
                finish(task, run)


def _acquire(
    task: Any,
    guard: TaskGuard,
    request: Any,
    key: str,
    ttl: float,
    done: str | None,
    header: dict[str, Any],
) -> tuple[Lease | None, LockInfo | None, float | None]:
    """The run's lease, or the holder that kept it from us (refused, holder the
    record, while the finished record ``done`` is held); with on_conflict="wait"
    also the seconds waited (one blocking acquire). A start deferred while the key
    is busy (a pending run, a rate= start) records its first refusal only."""
    opts = task.taskguard_options
    details = {
        "task_name": task.name,
        "task_id": stored_task_id(request.id),
        "hostname": request.hostname,
        "unless": done,
        "record_refusal": pending.polls_of(header) == 0,
        **opts.acquire_options,
    }
    if opts.on_conflict != "wait":
        lease, holder = acquire_or_holder(guard, key, ttl, **details)
        return lease, holder, None
    timeout = opts.wait_timeout
    if timeout is None:
        setting_value = setting(task._get_app(), "taskguard_wait_timeout")
        timeout = validate_ttl(setting_value, name="taskguard_wait_timeout")
    started = time.monotonic()
    attempt = guard.try_acquire(key, ttl, **details, wait=timeout)
    if attempt.lease is not None:
        return attempt.lease, None, None
    return None, attempt.holder, time.monotonic() - started


def _own(request: Any, holder: LockInfo | None) -> bool:
    return holder is not None and holder.holder.task_id == stored_task_id(request.id)


def _rate_countdown(slot: LockInfo | None) -> float:
    """[rate] Until the first slot frees (a little after, so it has by the database
    clock too), at least 0.05 s."""
    left = slot.expires_in.total_seconds() if slot is not None else 0.0
    return max(left, 0.0) + 0.05


def run_conflict(
    task: Any,
    guard: TaskGuard,
    request: Any,
    key: str,
    holder: LockInfo | None,
    *,
    own: bool = False,
    waited: float | None = None,
) -> Any:
    """Act on a key held at start: skip, raise, or retry (per ``on_conflict``); with
    ``rate=`` and no ``on_conflict``, defer."""
    opts = task.taskguard_options
    if completions.tracks(task, request) and completions.is_finished(guard, request.id):
        completions.drop_late_copy(task, request, key)
    # Another delivery of this very message (broker redelivery) holds it: never
    # drop or fail it; run it once that copy is done (then it is dropped as a late
    # copy if that one finished) or its lease ran out.
    own = own or _own(request, holder)
    described = describe_holder(holder)
    if opts.defer_busy and not own:  # [rate] a start waits its turn: never dropped
        signals.lock_conflict.send(sender=task, key=key, holder=holder, action="defer")
        log.info("%s[%s] waits: lock %r is held by %s", task.name, request.id, key, described)
        polls = pending.polls_of(header_of(request))
        countdown = poll_countdown(polls, holder)
        raise defer(task, request, key, countdown, "busy", {"polls": polls + 1})
    strategy = "retry" if own else opts.on_conflict
    if strategy in ("existing", "wait"):
        # A started task has nothing to point the caller at; a wait that timed
        # out gives up like "skip".
        strategy = "skip"
    signals.lock_conflict.send(sender=task, key=key, holder=holder, action=strategy)
    if strategy == "skip":
        log.warning(
            "skipped %s[%s]%s: lock %r is held by %s",
            task.name,
            request.id,
            f" after waiting {waited:.1f}s" if waited is not None else "",
            key,
            described,
        )
        return skipped_result(
            task=task.name, task_id=request.id, key=key, phase="run", holder=holder
        )
    if strategy == "raise":
        log.warning("refused %s[%s]: lock %r is held by %s", task.name, request.id, key, described)
        raise AlreadyLocked(key, holder)
    countdown = conflict_countdown(None if own else opts.retry_countdown, holder)
    if not opts.locks_run:  # lock="queue": the retry is checked again, like a deferral
        request.taskguard_deferred = True
    log.warning(
        "retrying %s[%s] in %.1fs (%s): lock %r is held by %s",
        task.name,
        request.id,
        countdown,
        "another delivery of this task id" if own else f"retry {request.retries + 1}",
        key,
        described,
    )
    raise task.retry(countdown=countdown, exc=AlreadyLocked(key, holder))


def finish(task: Any, run: ActiveRun, marker: Marker | None = None) -> None:
    """Give back the run's lease (unless a retry carries it on); ``marker`` is
    taken by the same release."""
    lease = run.lease
    assert lease is not None
    held_for = time.monotonic() - run.started
    if run.handed_over:
        log.debug("lock %r kept for the retry of %s", lease.key, task.name)
    else:
        released = release_quietly(run.guard, lease, marker)
        if not released and run.lost is None:
            log.warning(
                "lock %r (owner %s) had expired or been taken over before %s released it",
                lease.key,
                lease.owner,
                task.name,
            )
        send_released(task, lease, released, held_for)
