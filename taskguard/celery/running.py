"""The run side of a guarded task: one :class:`Run` per execution (worker or eager),
created by :meth:`GuardedTask.__call__`, holding the run's state from admission to
release.

A :class:`Run` is the core's run (:class:`taskguard.runs.GuardedRun`: the holder,
the finished record, the conflict entry, the hold and the release) with what only
Celery knows: its message (:class:`Header`), its actions (``Task.retry``; a late copy
raises ``Ignore``), pending places, start rates, hand-overs, deferrals, another
delivery of the same message (:data:`REDELIVERY`), which outcomes are final.

It reads top to bottom: :meth:`Run.execute` admits the message (a canvas member
answered at enqueue returns its marker; the key; the finished record to check),
acquires (or adopts the lease the message carries; a refusal goes to
:meth:`GuardedRun.refused`), starts (rate, pending place), runs the body while the
lease is renewed, and finishes: the lease is released in a ``finally`` so every
way out (return, exception, Reject, Ignore, soft time limit) gives it back exactly
once, with the finished record in the same statement; a ``retry()`` hands it to
the retry message instead. An outage before the body started puts the run off
(:mod:`taskguard.celery.deferral`).

Finished task ids: brokers deliver a message again when they think it was not
handled (Redis and SQS after their visibility timeout, also while the first copy
still runs; RabbitMQ when a connection drops before the ack), and Celery's own
de-duplication only looks at messages flagged ``redelivered``, where results
persist. So a run that finishes (returns, fails for good, is rejected without
requeue, or raises ``Ignore``) leaves a record of its task id (a row under
``taskguard:finished:<task id>`` for ``taskguard_finished_retention`` seconds, 0:
none; the reaper deletes it), which refuses the acquire of a later copy (inside the
acquire statement on PostgreSQL and SQLite) and is taken by the release (the same
statement on PostgreSQL): no statement of its own. That copy is dropped: one log
line, :data:`taskguard.signals.late_copy_dropped`, and ``Ignore`` (no result is
stored, so the first run's result stays). A run that never finished (its worker was
killed) leaves no record: its message may run again, as it always could.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery.exceptions import Ignore, Reject, Retry

from taskguard.celery import deferral, handover, pending, rate
from taskguard.celery.conflicts import DEFER, REDELIVERY
from taskguard.celery.deferral import defer
from taskguard.celery.lease_calls import acquire_or_holder, release_quietly
from taskguard.celery.message import Header, stored_task_id
from taskguard.celery.options import GuardOptions
from taskguard.config import guard_for
from taskguard.exceptions import AlreadyLocked, DatabaseUnavailable
from taskguard.held_lease import Interrupter, enter_run, exit_run
from taskguard.lease import Holder, Lease, LockInfo, Marker
from taskguard.options import Conflict, Phase
from taskguard.results import is_marker
from taskguard.runs import Actions, GuardedRun, finished_key

__all__ = ["Run"]

log = logging.getLogger("taskguard.celery")


class Run(GuardedRun, Actions):
    """One execution of a guarded task, from admission to release: the core's run
    (:class:`~taskguard.runs.GuardedRun`) plus what the run knows about its message:
    the task, the :class:`Header`, the arguments, whether its body started. It is
    its own :class:`~taskguard.runs.Actions` (Celery's side of a conflict)."""

    opts: GuardOptions
    #: From here on an outage is the body's own error.
    body_started = False
    #: A lock="queue" conflict retried: the retry checks the key again.
    deferred = False
    #: [coalesce/debounce] The key's pending place this run holds.
    waiting: Lease | None = None

    def __init__(self, task: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.task, self.request, self.args, self.kwargs = task, request, args, kwargs
        self.opts, self.ttl, self.retention = task._run_settings()
        self.guard, self.actions = guard_for(task._get_app()), self
        self.header = Header.of(request)

    @property
    def sender(self) -> Any:
        return self.task

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.task.name  # type: ignore[no-any-return]

    @property
    def task_id(self) -> str | None:  # type: ignore[override]
        return self.request.id  # type: ignore[no-any-return]

    # -- the life of a run, in order ----------------------------------------------------

    def execute(self) -> Any:
        """Admit, acquire, start, run the body, finish."""
        token = enter_run(self)
        try:
            return self._admit()
        except DatabaseUnavailable as exc:  # before the body started: tried again later
            raise deferral.retry_later(self, exc) from None
        finally:
            exit_run(token)

    def _admit(self) -> Any:
        request, header = self.request, self.header
        if header.marker is not None and is_marker(header.marker):
            return header.marker  # answered at enqueue; published only so the canvas goes on
        self.key = header.message_key(self.opts.deriver.derive, self.args, self.kwargs)
        tid = stored_task_id(request.id)
        self.holder = Holder(self.task.name, tid, request.hostname, os.getpid())
        if self.retention > 0 and not request.is_eager and tid is not None:
            # This run's finished record: refuses the acquire, then rides on the release.
            self.finished = Marker(finished_key(tid), self.retention, self.holder)
        if not self.opts.locks_run:
            return self._queue_phase()
        if self.opts.plain and header.lease is None:
            # The common case: one acquire, nothing to adopt, no pending place or rate.
            attempt = self.guard.take(self.key, self.ttl, self.holder, self.unless, phase=Phase.RUN)
            if attempt.lease is None:
                return self.refused(attempt.holder)
            self.hold(attempt.lease)
            return self._body()
        return self._acquire()

    def _queue_phase(self) -> Any:
        """lock="queue": the lease the message carried ends as the run starts."""
        first, blocked, holder = handover.start_queue_phase(
            self.task, self.guard, self.request, self.key, self.header
        )
        # A delivery that ended the queued lease is the first of its message to
        # start: none before it ran, so there is no finished record to read.
        if not first and self._finished_before():
            return self.late_copy()
        if blocked:
            return self.conflict(holder)
        return self._body()

    def _acquire(self) -> Any:
        """Every other acquire: a pending place first, the lease the message carries
        adopted, a blocking acquire (on_conflict="wait")."""
        task, guard, request, key, opts = self.task, self.guard, self.request, self.key, self.opts
        lease = None
        if opts.pending_runs:
            self.waiting, covered = pending.claim(task, guard, request, key, self.header)
            if covered is not None:
                return covered
        if self.header.lease is not None:
            lease, blocked, holder = handover.take_over(
                task, guard, request, key, self.header.lease, self.ttl
            )
            if blocked:  # another delivery of this task id has it
                return self.conflict(holder)
            # Adopting the hand-over took it from the owner id in the message, which no
            # delivery of this task id had taken before: none of them ran, let alone
            # finished. Otherwise the acquire below refuses a finished task id itself.
        taken = lease is None
        if lease is None:
            lease, holder, waited = self._take()
            if lease is None:
                return self.refused(holder, waited)
        return self._start(lease, taken)

    def _start(self, lease: Lease, taken: bool) -> Any:
        """Hold the lease (an outage before the body: the copy adopts it), then a
        rate= start counted, the pending place handed on."""
        task, opts = self.task, self.opts
        self.hold(lease, taken)
        if opts.rate is not None:  # [rate] count the start, or defer it
            counted, slot = rate.take_start(task, self.guard, self.request, self.key, opts.rate)  # type: ignore[arg-type]
            if not counted:
                self.release()
                extra = pending.carried(self.header, self.waiting)
                raise defer(task, self.request, self.key, _rate_countdown(slot), "rate", extra)
        if opts.pending_runs:  # [coalesce/debounce] the next submission becomes pending
            pending.started(self.guard, self.waiting, self.header)
        return self._body()

    def _take(self) -> tuple[Lease | None, LockInfo | None, float | None]:
        """The run's lease, or the holder that kept it from us (refused, holder the
        record, while the finished record is held); with on_conflict="wait" also the
        seconds waited (one blocking acquire)."""
        task, opts, h = self.task, self.opts, self.holder
        details = {
            "task_name": h.task_name,
            "task_id": h.task_id,
            "hostname": h.hostname,
            "unless": self.unless,
            # A start deferred while the key is busy (a pending run, a rate= start)
            # records its first refusal only.
            "record_refusal": self.header.polls == 0,
            "phase": Phase.RUN,
            **opts.acquire_options,
        }
        if not opts.mode.waits:  # a holder gone before it was read: tried again
            lease, holder = acquire_or_holder(self.guard, self.key, self.ttl, **details)
            return lease, holder, None
        timeout = task._durations().wait_timeout
        started = time.monotonic()
        attempt = self.guard.try_acquire(self.key, self.ttl, **details, wait=timeout)
        if attempt.lease is not None:
            return attempt.lease, None, None
        return None, attempt.holder, time.monotonic() - started

    def _body(self) -> Any:
        self.body_started = True
        if self.lease is not None:
            self.start_renewing()
            if self.opts.stop_on_lease_loss:
                self.interrupter = Interrupter(self.task.name).arm()
        try:
            if self.interrupter is None:
                result = self.task.run(*self.args, **self.kwargs)
            else:
                try:
                    result = self.task.run(*self.args, **self.kwargs)
                finally:
                    self.interrupter.disarm()  # first: nothing may interrupt the clean-up
        except BaseException as exc:
            self._finish(exc)
            raise
        self._finish(None)
        return result

    def _finish(self, outcome: BaseException | None) -> None:
        """After the body: release (with the finished record when the run is done for
        good), unless a retry carries the lease on."""
        final = self.finished is not None and outcome_is_final(outcome, self.task)
        if self.lease is not None and not self.handed_over:
            return self.release(final)
        if self.lease is not None:  # handed to a retry: its renewals end here
            self.stop_renewing()
        record = self.finished
        if final and record is not None:  # no lease to take it with: taken by itself
            try:
                self.guard.take(record.key, record.ttl, record.holder)
            except Exception as exc:  # only this protection is lost
                log.warning(
                    "could not record that %s[%s] finished: %s", self.name, self.task_id, exc
                )

    def _finished_before(self) -> bool:
        """Whether this run's finished record is held: a run of its task id finished."""
        info = self.guard.get(self.finished.key) if self.finished is not None else None
        return info is not None and info.held

    # -- a held key -------------------------------------------------------------------------

    def owns(self, holder: LockInfo | None) -> bool:
        """Whether ``holder`` holds the key under this run's task id: another delivery
        of this very message."""
        return holder is not None and holder.holder.task_id == stored_task_id(self.request.id)

    def conflict(self, holder: LockInfo | None, waited: float | None = None) -> Any:
        """Celery's side of a held key, before the core's (:meth:`GuardedRun.conflict`):
        a pending run waits for the key; a copy of a finished task id is dropped;
        another delivery of this very message (a broker redelivery) holds it: never
        dropped or failed, the key re-checked as a deferred start does (outside
        max_retries, at most about a second apart, never past the holder's expiry)
        and run once that copy is done (dropped as a late copy if it finished);
        ``rate=`` without ``on_conflict`` defers the start."""
        if self.opts.pending_runs and not self.owns(holder):
            return pending.wait_for_key(
                self.task, self.guard, self.request, self.key, holder, self.waiting, self.header
            )
        if self._finished_before():
            return self.late_copy()
        if self.owns(holder):
            return REDELIVERY.held_at_run(self, holder)
        if self.opts.conflict is Conflict.DEFER:
            return DEFER.held_at_run(self, holder)
        return super().conflict(holder, waited)

    # -- its actions (taskguard.runs.Actions) ----------------------------------------------

    def retry(self, countdown: float, error: AlreadyLocked) -> Any:
        """on_conflict="retry": ``Task.retry`` (counted against ``max_retries``)."""
        if not self.opts.locks_run:  # lock="queue": the retry is checked again, like a deferral
            self.deferred = True
        raise self.task.retry(countdown=countdown, exc=error)

    def dropped(self, value: dict[str, Any], error: AlreadyLocked) -> Any:
        """A late copy: its pending place given back, then Celery's ``Ignore`` (no
        result is stored, so the first run's result stays)."""
        if self.waiting is not None:  # [coalesce/debounce] not a run that will happen
            release_quietly(self.guard, self.waiting)
        raise Ignore()


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


def _rate_countdown(slot: LockInfo | None) -> float:
    """[rate] Until the first slot frees (a little after, so it has by the database
    clock too), at least 0.05 s."""
    left = slot.expires_in.total_seconds() if slot is not None else 0.0
    return max(left, 0.0) + 0.05
