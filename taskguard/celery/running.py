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
(see :mod:`taskguard.celery.completions`). An outage before the body started puts
the run off (:mod:`taskguard.celery.deferral`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from taskguard import signals
from taskguard.celery import completions, debounce, deferral, handoff, pending, rate
from taskguard.celery.conflicts import RETRY
from taskguard.celery.deferral import defer
from taskguard.celery.header import Header, stored_task_id
from taskguard.celery.leasing import release_quietly, send_released
from taskguard.celery.renewal import (
    ActiveRun,
    Heartbeat,
    Interrupter,
    enter_run,
    exit_run,
    valid_until,
)
from taskguard.celery.results import is_marker
from taskguard.config import guard_for, setting
from taskguard.exceptions import DatabaseUnavailable
from taskguard.keys import validate_ttl
from taskguard.lease import Lease, LockInfo, Marker

__all__ = ["Run"]

log = logging.getLogger("taskguard.celery")


class Run(ActiveRun):
    """One execution of a guarded task, from admission to release.

    The held lease's state (``lease``, ``lost``, ``valid_until``, ``handed_over``,
    ``interrupter``: :class:`~taskguard.celery.renewal.ActiveRun`) plus what the run
    knows about its message: the task, its options, the :class:`Header`, the
    arguments, the finished record it checks and leaves (``done``), the pending
    place it holds (``waiting``), whether its body started."""

    __slots__ = ("args", "body_started", "deferred", "done", "header", "kwargs", "opts", "task")

    def __init__(self, task: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
        super().__init__(guard_for(task._get_app()), "", None, request)
        self.task = task
        self.opts = task.taskguard_options
        self.header = Header.of(request)
        self.args = args
        self.kwargs = kwargs
        #: The key of this run's finished record (None: the run keeps none).
        self.done: str | None = None
        #: From here on an outage is the body's own error.
        self.body_started = False
        #: A lock="queue" conflict retried: the retry checks the key again.
        self.deferred = False

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
        task, request, header = self.task, self.request, self.header
        if header.marker is not None and is_marker(header.marker):
            return header.marker  # answered at enqueue; published only so the canvas goes on
        self.key = header.message_key(self.opts.deriver.derive, self.args, self.kwargs)
        if not request.is_eager and completions.retention(task) > 0:
            # This run's finished record: refuses the acquire, then rides on the release.
            self.done = completions.finished_key(request.id)
        if not self.opts.locks_run:
            return self._queue_phase()
        return self._acquire()

    def _queue_phase(self) -> Any:
        """lock="queue": the lease the message carried ends as the run starts."""
        task, request, key = self.task, self.request, self.key
        first, blocked, holder = handoff.start_queue_phase(
            task, self.guard, request, key, self.header
        )
        # A delivery that ended the queued lease is the first of its message to
        # start: none before it ran, so there is no finished record to read.
        if self.done is not None and not first and completions.is_finished(self.guard, request.id):
            completions.drop_late_copy(task, request, key)
        if blocked:
            return self.conflict(holder)
        return self._body()

    def _acquire(self) -> Any:
        task, guard, request, key, opts = self.task, self.guard, self.request, self.key, self.opts
        ttl = task._ttl()
        lease = None
        waiting = None  # [coalesce/debounce] the key's pending place this run holds
        if opts.pending_runs:
            waiting, covered = pending.claim(task, guard, request, key, self.header)
            if covered is not None:
                return covered
        if self.header.lease is not None:
            lease, blocked, holder = handoff.take_over(
                task, guard, request, key, self.header.lease, ttl
            )
            if blocked:
                return self.conflict(holder, own=True)
            # Adopting the hand-off took it from the owner id in the message, which no
            # delivery of this task id had taken before: none of them ran, let alone
            # finished. Otherwise the acquire below refuses a finished task id itself.
        if lease is None:
            lease, holder, waited = self._take(ttl)
            if lease is None:
                if self.done is not None and holder is not None and holder.key == self.done:
                    if waiting is not None:  # [coalesce/debounce] not a run that will happen
                        release_quietly(guard, waiting)
                    completions.drop_late_copy(task, request, key)
                if opts.pending_runs and not self._own(holder):
                    return pending.wait_for_key(
                        task, guard, request, key, holder, waiting, self.header
                    )
                return self.conflict(holder, waited=waited)
            signals.lock_acquired.send(sender=task, key=key, lease=lease)
        self.lease = lease  # an outage from here to the body: the copy adopts it
        self.started = time.monotonic()
        self.valid_until = valid_until(lease)
        if opts.rate is not None:  # [rate] count the start, or defer it
            counted, slot = rate.take_start(task, guard, request, key, opts.rate)
            if not counted:
                self.release()
                extra = pending.carried(self.header, waiting)
                raise defer(task, request, key, _rate_countdown(slot), "rate", extra)
        if opts.pending_runs:  # [coalesce/debounce] the next submission becomes pending
            pending.started(guard, waiting)
            debounce.started(guard, self.header)
        return self._body()

    def _take(self, ttl: float) -> tuple[Lease | None, LockInfo | None, float | None]:
        """The run's lease, or the holder that kept it from us (refused, holder the
        record, while the finished record is held); with on_conflict="wait" also the
        seconds waited (one blocking acquire)."""
        task, request, opts = self.task, self.request, self.opts
        details = {
            "task_name": task.name,
            "task_id": stored_task_id(request.id),
            "hostname": request.hostname,
            "unless": self.done,
            # A start deferred while the key is busy (a pending run, a rate= start)
            # records its first refusal only.
            "record_refusal": self.header.polls == 0,
            **opts.acquire_options,
        }
        if not opts.strategy.waits:
            # A conflict whose holder released before it could be read is tried again
            # (the key is likely free now).
            for _ in range(_ATTEMPTS_WHEN_FREED):
                attempt = self.guard.try_acquire(self.key, ttl, **details)
                if attempt.lease is not None or attempt.holder is not None:
                    break
            return attempt.lease, attempt.holder, None
        timeout = opts.wait_timeout
        if timeout is None:
            setting_value = setting(task._get_app(), "taskguard_wait_timeout")
            timeout = validate_ttl(setting_value, name="taskguard_wait_timeout")
        started = time.monotonic()
        attempt = self.guard.try_acquire(self.key, ttl, **details, wait=timeout)
        if attempt.lease is not None:
            return attempt.lease, None, None
        return None, attempt.holder, time.monotonic() - started

    def _body(self) -> Any:
        task = self.task
        self.body_started = True
        heartbeat = None
        if self.lease is not None:
            heartbeat = Heartbeat(self, task, self.request.id)
            if self.opts.stop_on_lease_loss:
                self.interrupter = Interrupter(task.name).arm()
        outcome: BaseException | None = None
        try:
            if heartbeat is not None:
                heartbeat.start()
            try:
                return task.run(*self.args, **self.kwargs)
            except BaseException as exc:
                outcome = exc
                raise
            finally:
                if self.interrupter is not None:
                    self.interrupter.disarm()  # first: nothing may interrupt the clean-up
        finally:
            if heartbeat is not None:
                heartbeat.stop()
            self._finish(outcome)

    def _finish(self, outcome: BaseException | None) -> None:
        """After the body: release (with the finished record when the run is done for
        good), unless a retry carries the lease on."""
        task, request = self.task, self.request
        final = self.done is not None and completions.outcome_is_final(outcome, task)
        if self.lease is not None and not self.handed_over:
            # The finished record goes with the release (one statement on PostgreSQL).
            self.release(completions.marker(task, request, self.done) if final else None)
            return
        if final:
            completions.record_finished(self.guard, task, request)
        if self.lease is not None:
            self.release()

    def release(self, marker: Marker | None = None) -> None:
        """Give back the run's lease (unless a retry carries it on); ``marker`` is
        taken by the same release."""
        lease = self.lease
        assert lease is not None
        if self.handed_over:
            log.debug("lock %r kept for the retry of %s", lease.key, self.task.name)
            return
        held_for = time.monotonic() - self.started
        released = release_quietly(self.guard, lease, marker)
        if not released and self.lost is None:
            log.warning(
                "lock %r (owner %s) had expired or been taken over before %s released it",
                lease.key,
                lease.owner,
                self.task.name,
            )
        send_released(self.task, lease, released, held_for)

    # -- a held key -------------------------------------------------------------------------

    def _own(self, holder: LockInfo | None) -> bool:
        return holder is not None and holder.holder.task_id == stored_task_id(self.request.id)

    def conflict(
        self, holder: LockInfo | None, *, own: bool = False, waited: float | None = None
    ) -> Any:
        """Act on a key held at start, per ``on_conflict`` (taskguard.celery.conflicts)."""
        if self.done is not None and completions.is_finished(self.guard, self.request.id):
            completions.drop_late_copy(self.task, self.request, self.key)
        # Another delivery of this very message (broker redelivery) holds it: never
        # drop or fail it; run it once that copy is done (then it is dropped as a late
        # copy if that one finished) or its lease ran out.
        if own or self._own(holder):
            return RETRY.at_run(self, holder, waited, own=True)
        return self.opts.strategy.at_run(self, holder, waited)


#: A conflict whose holder was gone when it was read means the key had just been
#: released: it is tried again this many times (then reported with holder None).
_ATTEMPTS_WHEN_FREED = 3


def _rate_countdown(slot: LockInfo | None) -> float:
    """[rate] Until the first slot frees (a little after, so it has by the database
    clock too), at least 0.05 s."""
    left = slot.expires_in.total_seconds() if slot is not None else 0.0
    return max(left, 0.0) + 0.05
