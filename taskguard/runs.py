"""A guarded run for any task framework: the run every integration's runs are
(django.tasks, Dramatiq and taskiq follow its whole protocol; Celery's
:class:`~taskguard.celery.running.Run` adds what only Celery knows), and the
conflict decisions they share.

An integration supplies only what its framework knows: the task's options and
arguments (:meth:`GuardSpec.of`, :meth:`GuardSpec.key`), the job id, and its
:class:`Actions` (how to hand back a skipped result, run a job again later, drop a
late copy, answer a duplicate enqueue with the queued job). The core decides the
rest: which action each ``on_conflict`` mode takes, at enqueue and in the run, and
its log line; the queue lease an enqueue takes and the run adopts
(:func:`enqueue_locked`); the lease held, renewed and given back around the body
(:class:`GuardedRun`); the record a finished job leaves so that another delivery
of it does not run again."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import cached_property
from typing import Any, TypeVar

from taskguard import signals
from taskguard.companions import FINISHED_PREFIX
from taskguard.config import guard_for, setting
from taskguard.exceptions import AlreadyLocked, OutcomeUnknown, TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.held_lease import Hold, Interrupter, enter_run, exit_run, release_when_reachable
from taskguard.held_lease import valid_until as local_deadline
from taskguard.lease import Holder, Lease, LockInfo, Marker, describe_holder
from taskguard.options import Conflict, Durations, Framework, GuardOptions, Phase, durations
from taskguard.results import skipped_result
from taskguard.validation import MAX_KEY_LENGTH, holder_for, normalize_key, validate_ttl

__all__ = [
    "Actions",
    "GuardSpec",
    "GuardedRun",
    "conflict_countdown",
    "conflict_line",
    "enqueue_locked",
    "report_conflict",
]

log = logging.getLogger("taskguard.runs")

T = TypeVar("T")

#: How long a duplicate enqueue waits for the enqueue holding the key to name its
#: job (``on_conflict="existing"``: it may be between its acquire and its publish).
JOB_ID_WAIT = 5.0
#: How much longer than its lease's time left a run waits for another delivery of its
#: own job to end (the lease ends by the database clock).
OUTLAST_MARGIN = 1.0
#: The shortest countdown of a conflict retry.
MIN_RETRY_COUNTDOWN = 0.5


def conflict_countdown(configured: float | None, holder: LockInfo | None) -> float:
    """Countdown of a conflict retry: ``retry_countdown`` if given, else the time left
    on the holder's lease, with jitter so that duplicates do not all come back at once."""
    if configured is not None:
        return configured
    left = holder.expires_in.total_seconds() if holder is not None else 0.0
    return max(MIN_RETRY_COUNTDOWN, left) * random.uniform(1.0, 1.2)


#: The log line of each conflict action (``{what}``: the task and its id).
_SAID = {
    Conflict.SKIP: "skipped {what}: lock {key!r} is held by {who}",
    Conflict.RAISE: "refused {what}: lock {key!r} is held by {who}",
    Conflict.RETRY: "retrying {what} in {countdown:.1f}s: lock {key!r} is held by {who}",
    Conflict.EXISTING: "not enqueued {what}: lock {key!r} is held by {who}; answering with it",
}


def conflict_line(
    action: Conflict,
    task: str,
    task_id: str | None,
    key: str,
    holder: LockInfo | None,
    *,
    countdown: float = 0.0,
    waited: float | None = None,
) -> str:
    """The log line of a conflict: what was done to which job, the key and who holds it."""
    what = f"{task}[{task_id}]" + (f" after waiting {waited:.1f}s" if waited else "")
    who = describe_holder(holder)
    return _SAID[action].format(what=what, key=key, who=who, countdown=countdown)


def report_conflict(
    action: Conflict, task: str, task_id: str | None, key: str, holder: LockInfo | None,
    *, sender: Any = None, **how: Any,
) -> None:  # fmt: skip
    """Log a conflict (:func:`conflict_line`, ``how``: its countdown or wait) and send
    :data:`~taskguard.signals.lock_conflict` (its sender: ``sender``, else the task's name)."""
    log.warning(conflict_line(action, task, task_id, key, holder, **how))
    waited = {"waited": how["waited"]} if how.get("waited") is not None else {}
    sender = task if sender is None else sender
    signals.lock_conflict.send(sender=sender, key=key, holder=holder, action=action, **waited)


class Actions:
    """What a framework does about a conflict; the core picks the action. Override
    what the framework can do (what it cannot is refused at declaration through its
    :class:`~taskguard.options.Framework`)."""

    def skip(self, value: dict[str, Any], error: AlreadyLocked) -> Any:
        """The job does not run: return what it returns (``value``: the skipped
        marker), or raise ``error`` where the framework has no such value."""
        return value

    def can_retry(self) -> bool:
        """Whether this job can be run again later (else ``on_conflict="retry"`` skips)."""
        return True

    def retry(self, countdown: float, error: AlreadyLocked) -> Any:
        """Run the job again in ``countdown`` seconds: raise the framework's retry, or
        enqueue a copy and return what the job returns."""
        raise error

    def existing(self, job_id: str) -> Any:
        """At enqueue: answer a duplicate with the queued job ``job_id``'s handle."""
        raise NotImplementedError

    def dropped(self, value: dict[str, Any], error: AlreadyLocked) -> Any:
        """A late copy of a finished job does not run (logged and signalled already):
        as :meth:`skip` unless overridden."""
        return self.skip(value, error)


#: The actions of a framework that overrides none.
SKIPPING = Actions()


@dataclass(frozen=True)
class GuardSpec:
    """A guarded task: its name, the core's options and, for frameworks that pass one
    (django.tasks' context), whether the first argument is left out of the key."""

    name: str
    opts: GuardOptions
    skip_first: bool = False

    @classmethod
    def of(
        cls,
        func: Callable[..., Any],
        framework: Framework,
        options: Mapping[str, Any],
        *,
        name: str | None = None,
        skip_first: bool = False,
    ) -> GuardSpec:
        """``func``'s options checked at declaration (one message per refusal)."""
        name = name or f"{func.__module__}.{func.__qualname__}"
        signature = inspect.signature(func)
        if skip_first:
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        return cls(name, GuardOptions.build(name, signature, framework, **options), skip_first)

    def key(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The lock key of a call with these arguments."""
        return self._derive(args[1:] if self.skip_first else args, dict(kwargs))

    @cached_property
    def _derive(self) -> Callable[[Any, Any], str]:
        return self.opts.deriver.derive

    def retention(self, app: Any) -> float:
        """:func:`finished_retention` of ``app``, read once (again for another app)."""
        seen = self.__dict__.get("_retention")
        if seen is None or seen[0] is not app:
            seen = self.__dict__["_retention"] = (app, finished_retention(app))
        return float(seen[1])

    def durations(self, app: Any) -> Durations:
        """The lease lengths and wait; ``app``: the settings taskguard.config reads."""
        return self._given or durations(self.opts, lambda name: setting(app, name))

    @cached_property
    def _given(self) -> Durations | None:
        # Durations no setting decides (ttl given, and a wait's timeout): computed once.
        opts = self.opts
        if opts.ttl is None or (opts.mode.waits and opts.wait_timeout is None):
            return None
        return durations(opts, lambda name: None)


def finished_key(task_id: str) -> str:
    """The key of the record a finished run of ``task_id`` (as stored) leaves."""
    key = FINISHED_PREFIX + task_id  # stored form already (what normalize_key returns), or:
    plain = len(key) <= MAX_KEY_LENGTH and key.isascii() and key.isprintable()
    return key if plain else normalize_key(key)


def finished_retention(app: Any) -> float:
    """``taskguard_finished_retention`` of ``app`` in seconds (0: no finished records)."""
    value = setting(app, "taskguard_finished_retention")
    return 0.0 if value in (0, None) else validate_ttl(value, name="taskguard_finished_retention")


class GuardedRun(Hold):
    """One execution of a guarded job: takes its lease (or adopts the one its enqueue
    took), acts on a conflict, renews while the body runs, gives the lease back after.
    Celery's run shares the holder, the finished record, the conflict entry
    (:meth:`refused`), :meth:`hold` and :meth:`release`.

    ``task_id``: the job's id (its enqueue's lease names it; with ``redelivers`` the
    finished record is keyed by it). ``redelivers``: the framework may deliver a job
    again after it finished (at-least-once brokers): a finished job leaves a record
    for ``taskguard_finished_retention`` and a later delivery of it does not run."""

    #: The record this run leaves when it finished for good (stored key, retention,
    #: this run's holder), which refuses a late copy's acquire; None: none.
    finished: Marker | None = None
    #: What the job returns when :meth:`start` says the body must not run.
    outcome: Any = None
    #: When (``time.monotonic()``) the lease was taken.
    started = 0.0
    #: This run's holder details (the task, its id, this host and process).
    holder: Holder
    _token: Any = None

    def __init__(
        self,
        spec: GuardSpec,
        app: Any,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        task_id: str | None = None,
        actions: Actions | None = None,
        redelivers: bool = False,
        guard: TaskGuard | None = None,
    ) -> None:
        self.guard, self.key = guard or guard_for(app), spec.key(args, kwargs)
        self.spec, self.opts, self.app, self.task_id = spec, spec.opts, app, task_id
        self.name = self.sender = spec.name
        self.actions = actions or SKIPPING
        self.holder = holder_for(self.guard.hostname, spec.name, task_id)
        if redelivers and task_id is not None and (retention := spec.retention(app)):
            self.finished = Marker(finished_key(task_id), retention, self.holder)

    # -- the protocol -----------------------------------------------------------------

    def start(self) -> bool:
        """Take the lease and stay this context's run (``check_lease()``,
        ``current_lease()``) until :meth:`exit`, armed for ``stop_on_lease_loss`` (a
        sync job, on its body's thread); ``False`` when the body must not run
        (:attr:`outcome`: what the job returns). Raises what the conflict action raises."""
        self._token = enter_run(self)  # before the grant (its spans: taskguard.otel)
        try:
            began = self._begin()
        except BaseException:
            self._leave()
            raise
        if not began:
            self._leave()
        elif self.lease is not None and self.opts.stop_on_lease_loss:
            self.interrupter = Interrupter(self.name).arm()
        return began

    def begin(self) -> bool:
        """:meth:`start`, leaving the context's run and arming nothing (:meth:`abegin`)."""
        token = enter_run(self)  # this context's run meanwhile (its spans: taskguard.otel)
        try:
            return self._begin()
        finally:
            exit_run(token)

    def _begin(self) -> bool:
        opts, guard = self.opts, self.guard
        times = self.spec.durations(self.app)
        lease = self._adopt(times.ttl) if opts.locks_queue else None
        if not opts.locks_run:  # the queue lease ends as the run starts
            if lease is not None:
                guard.release(lease)
            return True
        if lease is None:
            if opts.plain:  # one slot, no wait: the key and ttl are in stored form already
                lease, holder = guard.take(self.key, times.ttl, self.holder, self.unless, phase=Phase.RUN)  # fmt: skip
            else:
                lease, holder = guard.try_acquire(
                    self.key, times.ttl, wait=times.wait_timeout, task_name=self.name,
                    task_id=self.task_id, unless=self.unless, phase=Phase.RUN, **opts.acquire_options,
                )  # fmt: skip
            while (
                lease is None
                and holder is not None
                and self.owns(holder)
                and holder.key == self.key
            ):
                lease, holder = self._outlast(holder, times.ttl)
            if lease is None:
                self.outcome = self.refused(holder, times.wait_timeout if opts.mode.waits else None)
                return False
        self.hold(lease)
        self.start_renewing()
        return True

    def exit(self, final: bool = True) -> None:
        """Leave the run and :meth:`release` the lease (``final``: the job will not run
        again: it returned, or failed for good)."""
        if self.interrupter is not None:
            self.interrupter.disarm()
            self.interrupter = None
        self._leave()
        self.release(final)

    def run(self, body: Callable[[], T]) -> T | Any:
        """The whole protocol around a sync ``body``. A body that raised leaves no
        finished record: the framework may run the job again (a retry, same id)."""
        if not self.start():
            return self.outcome
        returned = False
        try:
            value = body()
            returned = True
            return value
        finally:
            self.exit(final=returned)  # disarms first: nothing interrupts the release

    def abandon(self) -> None:
        """The job will not run (its framework dropped it before its run began, e.g. an
        age limit): the lease its enqueue took for it goes back."""
        if self.opts.locks_queue and (lease := self._adopt(self.spec.durations(self.app).ttl)):
            self.guard.release(lease)

    # -- asyncio: each statement on a thread, never on the event loop ----------------

    async def abegin(self) -> bool:
        """:meth:`begin` off the event loop. Cancelled meanwhile: a lease it got is
        given back before the cancellation goes on."""
        began, cancelled = await _on_thread(self.begin)
        if cancelled:
            if began:
                await _on_thread(self.exit)
            raise asyncio.CancelledError
        if began:
            self._token = enter_run(self)  # the body's context
            if self.lease is not None and self.opts.stop_on_lease_loss:
                self.interrupter = Interrupter(self.name, asyncio.current_task()).arm()
        return bool(began)

    async def aexit(self, final: bool = True) -> None:
        """:meth:`exit` off the event loop (completes even when cancelled, then re-raises);
        with ``stop_on_lease_loss``, raises the :class:`LeaseLost` that cancelled the body."""
        self._leave()
        interrupter = self.interrupter
        try:
            cancelled = (await _on_thread(lambda: self.exit(final)))[1]
        finally:  # the loss first, also over a failed release of the lost lease
            if interrupter is not None and interrupter.error is not None:
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()  # the loss's cancellation, raised as the loss
                raise interrupter.error
        if cancelled:
            raise asyncio.CancelledError

    async def arun(self, body: Callable[[], Awaitable[T]]) -> T | Any:
        """The whole protocol around an async ``body`` (:meth:`run`'s, off the loop)."""
        if not await self.abegin():
            return self.outcome
        returned = False
        try:
            value = await body()
            returned = True
            return value
        finally:
            await self.aexit(final=returned)

    # -- what every integration's run shares -------------------------------------------

    @property
    def unless(self) -> str | None:
        """The key whose record refuses this run's acquire: its finished record's (a
        late copy's run is refused while the record is held)."""
        return self.finished and self.finished.key

    def hold(self, lease: Lease, taken: bool = True) -> None:
        """Hold ``lease`` from here on; one taken (not adopted) is announced
        (:data:`~taskguard.signals.lock_acquired`, sent only to receivers)."""
        if taken and signals.lock_acquired.receivers:
            signals.lock_acquired.send(sender=self.sender, key=self.key, lease=lease)
        self.lease, self.started, self.valid_until = lease, time.monotonic(), local_deadline(lease)

    def release(self, final: bool = False) -> None:
        """Stop renewing (waiting for a renewal in flight) and give the lease back, once;
        ``final``: the job is done for good, so its finished record is taken by the same
        statement. Never raises: a lease that had expired or been taken over is logged,
        so is a failed release (it then ends by expiry). Sends ``lock_released`` (only
        to receivers)."""
        if self.lease is None:
            return
        self.stop_renewing()
        lease, self.lease = self.lease, None
        released = release_quietly(self.guard, lease, self.finished if final else None)
        if not released and self.lost is None:
            log.warning("lock %r (owner %s) had expired or been taken over before %s[%s] "
                        "released it", lease.key, lease.owner, self.name, self.task_id)  # fmt: skip
        if signals.lock_released.receivers:
            held_for = time.monotonic() - self.started
            signals.lock_released.send(sender=self.sender, key=lease.key, lease=lease,
                                       held_for=held_for, released=released)  # fmt: skip

    def owns(self, holder: LockInfo | None) -> bool:
        """Whether ``holder`` holds the key under this job's id: another delivery of
        this very job (a broker delivered it again while that run's worker died, or
        while it still runs), not a duplicate."""
        return (
            holder is not None
            and self.task_id is not None
            and holder.holder.task_id == self.task_id
        )

    def refused(self, holder: LockInfo | None, waited: float | None = None) -> Any:
        """The conflict entry: the key (or this job's finished record) was held as the
        run started, ``waited`` seconds after it began waiting (``on_conflict="wait"``).
        A delivery of a job that finished is a late copy; anything else a conflict."""
        if self.finished is not None and holder is not None and holder.key == self.finished.key:
            return self.late_copy(holder)
        return self.conflict(holder, waited)

    def late_copy(self, holder: LockInfo | None = None) -> Any:
        """Drop a delivery of a job that already finished: logged, sent as
        :data:`~taskguard.signals.late_copy_dropped`, then :meth:`Actions.dropped`."""
        log.warning("dropped a late copy of finished %s[%s] (lock %r): a run of this task "
                    "id already finished", self.name, self.task_id, self.key)  # fmt: skip
        signals.late_copy_dropped.send(sender=self.sender, key=self.key, task_id=self.task_id)
        return self.actions.dropped(self._skipped(holder), AlreadyLocked(self.key, holder))

    def conflict(self, holder: LockInfo | None, waited: float | None = None) -> Any:
        """Act on the held key per ``on_conflict`` (the log line and signal:
        :func:`report_conflict`; the action: the framework's :class:`Actions`)."""
        mode, error = self.opts.conflict, AlreadyLocked(self.key, holder)
        if mode is Conflict.RAISE:
            self._report(mode, holder, waited=waited)
            raise error
        if mode is Conflict.RETRY and self.actions.can_retry():
            countdown = conflict_countdown(self.opts.retry_countdown, holder)
            self._report(mode, holder, countdown=countdown)
            return self.actions.retry(countdown, error)
        if mode is Conflict.RETRY:
            log.warning("task %s[%s] cannot be run again later (on_conflict='retry'): skipping",
                        self.name, self.task_id)  # fmt: skip
        self._report(Conflict.SKIP, holder, waited=waited)
        return self.actions.skip(self._skipped(holder), error)

    # -- inside ------------------------------------------------------------------------

    def _leave(self) -> None:
        if self._token is not None:  # no longer this context's run
            exit_run(self._token)
            self._token = None

    def _report(self, action: Conflict, holder: LockInfo | None, **how: Any) -> None:
        report_conflict(
            action, self.name, self.task_id, self.key, holder, sender=self.sender, **how
        )

    def _skipped(self, holder: LockInfo | None) -> dict[str, Any]:
        return skipped_result(
            task=self.name, task_id=self.task_id, key=self.key, phase="run", holder=holder
        )

    def _outlast(self, holder: LockInfo, ttl: float) -> tuple[Lease | None, LockInfo | None]:
        # Another delivery of this job holds the key: never skipped as a duplicate (the
        # job would be lost with a dead worker); it waits for that lease to end, then
        # runs, or is a late copy if that delivery finished meanwhile.
        left = max(holder.expires_in.total_seconds(), 0.0) + OUTLAST_MARGIN
        log.warning("task %s[%s]: lock %r is held by another delivery of this job (%s): waiting "
                    "up to %.1fs for its lease to end", self.name, self.task_id, self.key,
                    describe_holder(holder), left)  # fmt: skip
        return self.guard.try_acquire(
            self.key, ttl, wait=left, task_name=self.name, task_id=self.task_id,
            unless=self.unless, phase=Phase.RUN, **self.opts.acquire_options,
        )  # fmt: skip

    def _adopt(self, ttl: float) -> Lease | None:
        # The lease the enqueue took for this job (its holder names the job, or no job
        # yet: the enqueue names it once the framework gave it an id).
        if self.task_id is None:
            return None
        mine = [
            r
            for r in self.guard.get_all(self.key)
            if r.held
            and r.holder.task_name == self.name
            and r.holder.task_id in (None, self.task_id)
        ]
        if not mine:
            return None
        return self.guard.adopt(
            self.key, mine[0].owner, ttl, slot=mine[0].slot, exclusive=True,
            task_name=self.name, task_id=self.task_id, phase=Phase.RUN,
        )  # fmt: skip


def enqueue_locked(
    spec: GuardSpec,
    app: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    publish: Callable[[], T],
    *,
    job_id: Callable[[T], str],
    actions: Actions | None = None,
    task_id: str | None = None,
    guard: TaskGuard | None = None,
) -> T | Any:
    """Enqueue a ``lock="queue"``/``"queue_and_run"`` job: take its key for
    ``queue_ttl``, then ``publish()``; the job's run adopts the lease. A duplicate is
    not published: ``skip`` returns ``actions.skip(marker)``, ``existing`` answers with
    the queued job (``actions.existing``), ``retry`` calls ``actions.retry`` (enqueue a
    copy later), any other mode raises :class:`~taskguard.AlreadyLocked`.

    ``task_id``: the job's id if known before publishing (the lease names it at
    once); else ``job_id(handle)`` names it after. A failed publish gives the lease
    back; an acquire whose outcome is unknown is given back once the database answers."""
    actions = actions or Actions()
    guard = guard or guard_for(app)
    key, ttl = spec.key(args, kwargs), spec.durations(app).queue_ttl
    try:
        lease, holder = guard.try_acquire(
            key, ttl, task_name=spec.name, task_id=task_id, phase=Phase.QUEUE,
            **spec.opts.acquire_options,
        )  # fmt: skip
    except OutcomeUnknown as exc:  # it may land later: given back once the database answers
        now = datetime.now(timezone.utc)
        maybe = Lease(key, exc.owner, 0, now, now + timedelta(seconds=ttl), ttl)
        release_when_reachable(guard, [maybe], f"{spec.name}: enqueue failed", landing=True)
        raise
    if lease is None:
        return _duplicate(spec, guard, key, holder, actions, task_id)
    try:
        handle = publish()
    except BaseException:
        guard.release(lease)
        raise
    if task_id is None:  # name the job on its lease (None: its run already adopted it)
        guard.adopt(key, lease.owner, ttl, slot=lease.slot, exclusive=True,
                    task_name=spec.name, task_id=job_id(handle))  # fmt: skip
    return handle


def _duplicate(
    spec: GuardSpec,
    guard: TaskGuard,
    key: str,
    holder: LockInfo | None,
    actions: Actions,
    task_id: str | None,
) -> Any:
    mode = spec.opts.conflict
    if mode is Conflict.EXISTING:
        deadline = time.monotonic() + JOB_ID_WAIT  # the holder may not have named its job yet
        while holder is not None and holder.holder.task_id is None:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
            holder = next((r for r in guard.get_all(key) if r.held), None)
        job = holder.holder.task_id if holder is not None else None
        if job is not None:
            report_conflict(mode, spec.name, task_id, key, holder)
            return actions.existing(job)
        mode = Conflict.SKIP  # nothing queued to point at
    refused = AlreadyLocked(
        key,
        holder,
        f"task {spec.name}: not enqueued: a job for lock {key!r} is already queued or "
        f"running ({describe_holder(holder)})",
    )
    if mode is Conflict.SKIP:
        report_conflict(mode, spec.name, task_id, key, holder)
        marker = skipped_result(
            task=spec.name, task_id=task_id, key=key, phase="queue", holder=holder
        )
        return actions.skip(marker, refused)
    if mode is Conflict.RETRY:
        countdown = conflict_countdown(spec.opts.retry_countdown, holder)
        report_conflict(mode, spec.name, task_id, key, holder, countdown=countdown)
        return actions.retry(countdown, refused)
    report_conflict(Conflict.RAISE, spec.name, task_id, key, holder)
    raise refused


def release_quietly(
    guard: TaskGuard, lease: Lease, marker: Marker | None = None, reason: str | None = None
) -> bool:
    """Give ``lease`` back without raising (a failure is logged: the lease then ends by
    expiry); ``marker``: complete (see :meth:`TaskGuard.give_back`); ``reason``: why,
    for the history (see :meth:`TaskGuard.release`)."""
    try:
        return guard.give_back(lease, marker, reason)
    except TaskGuardError as exc:
        log.error(
            "could not release lock %r (owner %s): %s; it ends by expiry at %s",
            lease.key,
            lease.owner,
            exc,
            lease.expires_at.isoformat(),
        )
        return False


async def _on_thread(call: Callable[[], Any]) -> tuple[Any, bool]:
    """``call()`` on a thread (in this context), and whether the coroutine was cancelled
    meanwhile: the statement on the thread outlives a cancellation, so it is waited for.
    (The executor's future awaited through a shield: one event-loop turn fewer per call
    than a task around ``to_thread`` and ``asyncio.wait``.)"""
    done = asyncio.get_running_loop().run_in_executor(None, contextvars.copy_context().run, call)
    cancelled = False
    while True:
        try:
            return await asyncio.shield(done), cancelled
        except asyncio.CancelledError:
            if done.cancelled():  # the executor's own future (the loop is closing)
                raise
            cancelled = True
