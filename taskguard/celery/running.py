"""The run side of a guarded task: one :class:`Run` per execution (worker or eager),
created by :meth:`GuardedTask.__call__`, holding the run's state from admission to
release.

It reads top to bottom: :meth:`Run.execute` admits the message (a canvas member
answered at enqueue returns its marker; the key; the finished record to check),
acquires (or adopts the lease the message carries; a conflict goes to
:meth:`Run.conflict`), starts (rate, pending place), runs the body while the
lease is renewed, and finishes: the lease is released in a ``finally`` so every
way out (return, exception, Reject, Ignore, soft time limit) gives it back exactly
once, with the finished record in the same statement; a ``retry()`` hands it to
the retry message instead. A copy of a task id that already finished is dropped
(see :mod:`taskguard.celery.lease_calls`). An outage before the body started puts
the run off (:mod:`taskguard.celery.deferral`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from taskguard import signals
from taskguard.celery import deferral, handover, pending, rate
from taskguard.celery.conflicts import REDELIVERY
from taskguard.celery.deferral import defer
from taskguard.celery.finished import (
    drop_late_copy,
    finished_key,
    is_finished,
    outcome_is_final,
    record_finished,
)
from taskguard.celery.lease_calls import acquire_or_holder, release_quietly, send_released
from taskguard.celery.message import Header, stored_task_id
from taskguard.config import guard_for
from taskguard.exceptions import DatabaseUnavailable
from taskguard.held_lease import Hold, Interrupter, enter_run, exit_run, valid_until
from taskguard.lease import Holder, Lease, LockInfo, Marker
from taskguard.options import Phase
from taskguard.results import is_marker

__all__ = ["Run"]

log = logging.getLogger("taskguard.celery")


class Run(Hold):
    """One execution of a guarded task, from admission to release: the held lease's
    state (:class:`~taskguard.held_lease.Hold`: ``lease``, ``lost``, ``valid_until``,
    ``handed_over``, ``interrupter``) plus what the run knows about its message: the
    task, its options, the :class:`Header`, the arguments, the finished record it
    checks and leaves (``done``), whether its body started."""

    #: The key of this run's finished record (None: the run keeps none).
    done: str | None = None
    #: From here on an outage is the body's own error.
    body_started = False
    #: A lock="queue" conflict retried: the retry checks the key again.
    deferred = False
    started = 0.0

    def __init__(self, task: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.task, self.request, self.args, self.kwargs = task, request, args, kwargs
        self.opts, self.ttl, self.retention = task._run_settings()
        self.guard = guard_for(task._get_app())
        self.header = Header.of(request)

    @property
    def sender(self) -> Any:
        return self.task

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
        if self.retention > 0 and not request.is_eager:
            # This run's finished record: refuses the acquire, then rides on the release.
            self.done = finished_key(tid)
        if not self.opts.locks_run:
            return self._queue_phase()
        if self.opts.plain and header.lease is None:
            # The common case: one acquire, nothing to adopt, no pending place or rate.
            attempt = self.guard.take(self.key, self.ttl, self.holder, self.done, phase=Phase.RUN)
            if attempt.lease is None:
                return self._refused(attempt.holder, None, None)
            self._hold(attempt.lease, taken=True)
            return self._body()
        return self._acquire()

    def _queue_phase(self) -> Any:
        """lock="queue": the lease the message carried ends as the run starts."""
        task, request, key = self.task, self.request, self.key
        first, blocked, holder = handover.start_queue_phase(
            task, self.guard, request, key, self.header
        )
        # A delivery that ended the queued lease is the first of its message to
        # start: none before it ran, so there is no finished record to read.
        if self.done is not None and not first and is_finished(self.guard, request.id):
            drop_late_copy(task, request, key)
        if blocked:
            return self.conflict(holder)
        return self._body()

    def _acquire(self) -> Any:
        """Every other acquire: a pending place first, the lease the message carries
        adopted, a blocking acquire (on_conflict="wait")."""
        task, guard, request, key, opts = self.task, self.guard, self.request, self.key, self.opts
        ttl = self.ttl
        lease = None
        waiting = None  # [coalesce/debounce] the key's pending place this run holds
        if opts.pending_runs:
            waiting, covered = pending.claim(task, guard, request, key, self.header)
            if covered is not None:
                return covered
        if self.header.lease is not None:
            lease, blocked, holder = handover.take_over(
                task, guard, request, key, self.header.lease, ttl
            )
            if blocked:  # another delivery of this task id has it
                return self.conflict(holder)
            # Adopting the hand-over took it from the owner id in the message, which no
            # delivery of this task id had taken before: none of them ran, let alone
            # finished. Otherwise the acquire below refuses a finished task id itself.
        taken = lease is None
        if lease is None:
            lease, holder, waited = self._take(ttl)
            if lease is None:
                return self._refused(holder, waited, waiting)
        return self._start(lease, waiting, taken)

    def _refused(self, holder: LockInfo | None, waited: float | None, waiting: Lease | None) -> Any:
        """The key was held: a finished copy is dropped, a pending run waits, anything
        else is a conflict."""
        task, request, key = self.task, self.request, self.key
        if self.done is not None and holder is not None and holder.key == self.done:
            if waiting is not None:  # [coalesce/debounce] not a run that will happen
                release_quietly(self.guard, waiting)
            drop_late_copy(task, request, key)
        if self.opts.pending_runs and not self.owns(holder):
            return pending.wait_for_key(
                task, self.guard, request, key, holder, waiting, self.header
            )
        return self.conflict(holder, waited)

    def _hold(self, lease: Lease, taken: bool) -> None:
        """Hold ``lease`` from here on (an outage before the body: the copy adopts
        it); a lease taken (not adopted) is announced."""
        if taken and signals.lock_acquired.receivers:
            signals.lock_acquired.send(sender=self.task, key=self.key, lease=lease)
        self.lease, self.started, self.valid_until = lease, time.monotonic(), valid_until(lease)

    def _start(self, lease: Lease, waiting: Lease | None, taken: bool) -> Any:
        """:meth:`_hold`, then a rate= start counted, the pending place handed on."""
        task, opts = self.task, self.opts
        self._hold(lease, taken)
        if opts.rate is not None:  # [rate] count the start, or defer it
            counted, slot = rate.take_start(task, self.guard, self.request, self.key, opts.rate)
            if not counted:
                self.release()
                extra = pending.carried(self.header, waiting)
                raise defer(task, self.request, self.key, _rate_countdown(slot), "rate", extra)
        if opts.pending_runs:  # [coalesce/debounce] the next submission becomes pending
            pending.started(self.guard, waiting, self.header)
        return self._body()

    def _take(self, ttl: float) -> tuple[Lease | None, LockInfo | None, float | None]:
        """The run's lease, or the holder that kept it from us (refused, holder the
        record, while the finished record is held); with on_conflict="wait" also the
        seconds waited (one blocking acquire)."""
        task, opts, h = self.task, self.opts, self.holder
        details = {
            "task_name": h.task_name,
            "task_id": h.task_id,
            "hostname": h.hostname,
            "unless": self.done,
            # A start deferred while the key is busy (a pending run, a rate= start)
            # records its first refusal only.
            "record_refusal": self.header.polls == 0,
            "phase": Phase.RUN,
            **opts.acquire_options,
        }
        if not opts.mode.waits:  # a holder gone before it was read: tried again
            lease, holder = acquire_or_holder(self.guard, self.key, ttl, **details)
            return lease, holder, None
        timeout = task._durations().wait_timeout
        started = time.monotonic()
        attempt = self.guard.try_acquire(self.key, ttl, **details, wait=timeout)
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
        """After the body: stop renewing, then release (with the finished record when
        the run is done for good), unless a retry carries the lease on."""
        final = self.done is not None and outcome_is_final(outcome, self.task)
        if self.lease is not None:
            self.stop_renewing()
            if not self.handed_over:
                # The finished record goes with the release (one statement on PostgreSQL).
                done = self.done if final else None
                return self.release(Marker(done, self.retention, self.holder) if done else None)
            log.debug("lock %r kept for the retry of %s", self.key, self.task.name)
        if final:
            record_finished(self.guard, self.task, self.request)
        return None

    def release(self, marker: Marker | None = None) -> None:
        """Give back the run's lease (not handed to a retry); ``marker`` is taken by the
        same release."""
        lease = self.lease
        assert lease is not None and not self.handed_over
        released = release_quietly(self.guard, lease, marker)
        if not released and self.lost is None:
            log.warning(
                "lock %r (owner %s) had expired or been taken over before %s released it",
                lease.key,
                lease.owner,
                self.task.name,
            )
        send_released(self.task, lease, released, time.monotonic() - self.started)

    # -- a held key -------------------------------------------------------------------------

    def owns(self, holder: LockInfo | None) -> bool:
        """Whether ``holder`` holds the key under this run's task id: another delivery
        of this very message."""
        return holder is not None and holder.holder.task_id == stored_task_id(self.request.id)

    def conflict(self, holder: LockInfo | None, waited: float | None = None) -> Any:
        """Act on a key held at start, per ``on_conflict`` (taskguard.celery.conflicts)."""
        if self.done is not None and is_finished(self.guard, self.request.id):
            drop_late_copy(self.task, self.request, self.key)
        # Another delivery of this very message (broker redelivery) holds it: never
        # drop or fail it; re-check the key as a deferred start does (outside
        # max_retries, at most about a second apart, never past the holder's expiry)
        # and run it once that copy is done (dropped as a late copy if it finished).
        if self.owns(holder):
            return REDELIVERY.held_at_run(self, holder, waited)
        return self.opts.strategy.held_at_run(self, holder, waited)


def _rate_countdown(slot: LockInfo | None) -> float:
    """[rate] Until the first slot frees (a little after, so it has by the database
    clock too), at least 0.05 s."""
    left = slot.expires_in.total_seconds() if slot is not None else 0.0
    return max(left, 0.0) + 0.05
