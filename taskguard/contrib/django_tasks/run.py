"""``@guarded``: the run-time lock of a django.tasks task, for any backend: the core's
options (taskguard.options), the job a worker starts (its signals), the held lease
(taskguard.holding: renewed while the body runs, released at the end)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from django.utils import timezone

from taskguard.config import guard_for, setting
from taskguard.contrib.django import conf
from taskguard.contrib.django_tasks.framework import task_finished, task_started
from taskguard.exceptions import AlreadyLocked, ConfigurationError
from taskguard.guard import TaskGuard
from taskguard.holding import Hold, Interrupter, enter_run, exit_run, valid_until
from taskguard.lease import MARKER, Lease, LockInfo, describe_holder, skipped_result
from taskguard.options import Conflict, Durations, Framework, GuardOptions, durations

__all__ = ["DEFERRED", "DJANGO_TASKS", "GuardSpec", "guarded", "project_guard"]

log = logging.getLogger("taskguard.django_tasks")

#: What django.tasks cannot honour (the core refuses it, naming the framework).
DJANGO_TASKS = Framework(
    "django.tasks",
    frozenset({"rate", "coalesce_replace", "debounce", "debounce_max", Conflict.COALESCE}),
)
#: ``value[MARKER]`` of a run put back in the queue by ``on_conflict="retry"``.
DEFERRED = "deferred"

# The TaskResult the worker is about to run in this context (task_started is sent
# by every worker backend just before it calls the function).
_started: contextvars.ContextVar[Any] = contextvars.ContextVar("taskguard_task_result")
for _signal, _value in ((task_started, True), (task_finished, False)):
    _signal.connect(
        lambda task_result, value=_value, **_: _started.set(task_result if value else None),
        dispatch_uid=f"taskguard.django_tasks.{_value}",
        weak=False,
    )


def _settings() -> SimpleNamespace:
    # Django's TASKGUARD_* settings in the shape taskguard.config reads.
    return SimpleNamespace(
        conf={**conf.celery_settings(), "taskguard_database_url": conf.database_url()}
    )


def project_guard() -> TaskGuard:
    """The process's :class:`TaskGuard` for the Django project's ``TASKGUARD_*``
    settings (the locks database is ``TASKGUARD_DATABASE_ALIAS``)."""
    return guard_for(_settings())


@dataclass(frozen=True)
class GuardSpec:
    """A guarded task: its name, the core's options, whether it takes a context."""

    name: str
    opts: GuardOptions
    takes_context: bool

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return self.opts.deriver.derive(args[1:] if self.takes_context else args, kwargs)

    def durations(self) -> Durations:
        found = _settings()
        return durations(self.opts, lambda name: setting(found, name))


def _spec(func: Callable[..., Any], options: dict[str, Any]) -> GuardSpec:
    if not inspect.isfunction(func):
        raise ConfigurationError(
            f"@guarded got {func!r}, not a function: place @guarded under @task "
            "(@task() on the line above @guarded(...))"
        )
    name = f"{func.__module__}.{func.__qualname__}"
    signature = inspect.signature(func)
    params = list(signature.parameters.values())
    takes_context = bool(params) and params[0].name == "context"  # django.tasks' rule
    if takes_context:
        signature = signature.replace(parameters=params[1:])
    return GuardSpec(
        name, GuardOptions.build(name, signature, DJANGO_TASKS, **options), takes_context
    )


def _skip(run: _Run, holder: LockInfo | None, who: str) -> Any:
    log.warning("task %s (%s) skipped: lock %r is held by %s", run.name, run.task_id, run.key, who)
    return skipped_result(
        task=run.name, task_id=run.task_id, key=run.key, phase="run", holder=holder
    )


def _raise(run: _Run, holder: LockInfo | None, who: str) -> Any:
    log.warning("task %s (%s) refused: lock %r is held by %s", run.name, run.task_id, run.key, who)
    raise AlreadyLocked(run.key, holder)


def _retry(run: _Run, holder: LockInfo | None, who: str) -> Any:
    result = run.result
    if result is None or not result.task.get_backend().supports_defer:
        log.warning("task %s: backend cannot defer a job (on_conflict='retry'): skipping", run.name)
        return _skip(run, holder, who)
    left = holder.expires_in.total_seconds() if holder is not None else 1.0
    countdown = run.spec.opts.retry_countdown or max(left, 0.1)
    at = timezone.now() + timedelta(seconds=countdown)
    again = result.task.using(run_after=at).enqueue(*result.args, **result.kwargs)
    log.warning(
        "task %s (%s): lock %r is held by %s; deferred %.1fs as %s",
        *(run.name, run.task_id, run.key, who, countdown, again.id),
    )
    return {MARKER: DEFERRED, "task": run.name, "task_id": run.task_id, "key": run.key,
            "retry_id": again.id}  # fmt: skip


#: What a conflict in the run does, by the core's conflict mode (else: skipped).
_ACTIONS = {Conflict.RAISE: _raise, Conflict.RETRY: _retry}


class _Run(Hold):
    """One guarded execution: takes (or adopts) the lease, renews it while the body
    runs, releases it after. ``outcome`` is set instead when the body must not run."""

    def __init__(self, spec: GuardSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.spec, self.name = spec, spec.name
        context_result = args[0].task_result if spec.takes_context and args else None
        result = context_result or _started.get(None)
        # (a guarded function called directly inside another task's body is not that job)
        self.result = (
            result if result is not None and result.task.module_path == self.name else None
        )
        super().__init__(project_guard(), spec.key(args, kwargs), None, None)
        self.task_id = self.result.id if self.result is not None else None
        self.sender, self.outcome = self.name, None

    def begin(self) -> bool:
        """Take the lease; ``False`` when the body must not run (``outcome`` is then
        what the task returns)."""
        opts, guard, times = self.spec.opts, self.guard, self.spec.durations()
        if opts.locks_queue and self.result is not None:
            backend = self.result.task.get_backend()
            if not getattr(backend, "takes_queue_leases", False):
                raise ConfigurationError(
                    f"task {self.name}: lock='{opts.lock}' needs the enqueue to take the lock: "
                    f"set TASKS[{backend.alias!r}]['BACKEND'] to "
                    "'taskguard.contrib.django_tasks.GuardedBackend' (the current backend "
                    "in its OPTIONS), or use lock='run'"
                )
        lease = self._adopt(times.ttl) if opts.locks_queue else None
        if not opts.locks_run:  # the queue lease ends as the run starts
            if lease is not None:
                guard.release(lease)
            return True
        if lease is None:
            lease, holder = guard.try_acquire(
                self.key, times.ttl, wait=times.wait_timeout, task_name=self.name,
                task_id=self.task_id, **opts.acquire_options,
            )  # fmt: skip
            if lease is None:
                who = describe_holder(holder)
                self.outcome = _ACTIONS.get(opts.conflict, _skip)(self, holder, who)
                return False
        self.lease = lease
        self.valid_until = valid_until(lease)
        self.start_renewing()
        return True

    def _adopt(self, ttl: float) -> Lease | None:
        # The lease GuardedBackend took for this job at enqueue (its holder names the job).
        mine = [
            r
            for r in self.guard.get_all(self.key)
            if r.held
            and r.holder.task_name == self.name
            and r.holder.task_id in (None, self.task_id)
        ]
        if self.task_id is None or not mine:
            return None
        return self.guard.adopt(
            self.key, mine[0].owner, ttl, slot=mine[0].slot, exclusive=True,
            task_name=self.name, task_id=self.task_id,
        )  # fmt: skip

    def arm(self) -> None:
        if self.lease is not None and self.spec.opts.stop_on_lease_loss:
            self.interrupter = Interrupter(self.name).arm()

    def end(self) -> None:
        if self.interrupter is not None:
            self.interrupter.disarm()
        if self.lease is None:
            return
        self.stop_renewing()
        if not self.guard.release(self.lease):
            log.warning("task %s: lease on %r had expired or been taken over at release",
                        self.name, self.key)  # fmt: skip


async def _on_thread(call: Callable[[], Any]) -> tuple[Any, bool]:
    """``call()`` on a thread, and whether the coroutine was cancelled meanwhile: the
    statement on the thread outlives a cancellation, so it is waited for."""
    done = asyncio.ensure_future(asyncio.to_thread(call))
    cancelled = False
    while not done.done():
        try:
            await asyncio.wait([done])
        except asyncio.CancelledError:
            cancelled = True
    return done.result(), cancelled


def guarded(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Lock a django.tasks task per key while it runs; place it under ``@task``
    (``@task()`` then ``@guarded(key="feed:{url}", ttl=60)``). The options are
    ``@guarded_task``'s but what django.tasks cannot honour (taskguard.options);
    the queue phases need :class:`GuardedBackend`. docs/django-tasks.md."""

    def decorate(f: Callable[..., Any]) -> Any:
        spec = _spec(f, dict(options))
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                run = _Run(spec, args, kwargs)
                began, cancelled = await _on_thread(run.begin)
                if cancelled:  # the lease it got is given back before the cancellation goes on
                    if began:
                        await _on_thread(run.end)
                    raise asyncio.CancelledError
                if not began:
                    return run.outcome
                token = enter_run(run)  # in the body's own context (no interrupter)
                try:
                    return await f(*args, **kwargs)
                finally:
                    exit_run(token)
                    if (await _on_thread(run.end))[1]:
                        raise asyncio.CancelledError

            run_async.taskguard = spec  # type: ignore[attr-defined]
            return run_async

        @functools.wraps(f)
        def run_sync(*args: Any, **kwargs: Any) -> Any:
            run = _Run(spec, args, kwargs)
            if not run.begin():
                return run.outcome
            token = enter_run(run)
            try:
                run.arm()
                return f(*args, **kwargs)
            finally:
                run.end()  # disarms first: nothing interrupts the release
                exit_run(token)

        run_sync.taskguard = spec  # type: ignore[attr-defined]
        return run_sync

    return decorate(func) if func is not None else decorate
