"""``@guarded``: the run-time lock of a django.tasks task, for any backend: what
django.tasks tells the core's guarded run (taskguard.runs): the job a worker starts
(its signals), its settings, how it runs a job again later."""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from django.utils import timezone

from taskguard.config import guard_for
from taskguard.contrib.django import conf
from taskguard.contrib.django_tasks.framework import task_finished, task_started
from taskguard.exceptions import AlreadyLocked, ConfigurationError
from taskguard.guard import TaskGuard
from taskguard.options import Conflict, Framework
from taskguard.results import MARKER
from taskguard.runs import Actions, GuardedRun, GuardSpec

__all__ = ["guarded", "project_guard"]

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


def project_settings() -> SimpleNamespace:
    # Django's TASKGUARD_* settings in the shape taskguard.config reads.
    return SimpleNamespace(
        conf={**conf.celery_settings(), "taskguard_database_url": conf.database_url()}
    )


def project_guard() -> TaskGuard:
    """The process's :class:`TaskGuard` for the Django project's ``TASKGUARD_*``
    settings (the locks database is ``TASKGUARD_DATABASE_ALIAS``)."""
    return guard_for(project_settings())


def _spec(func: Callable[..., Any], options: dict[str, Any]) -> GuardSpec:
    if not inspect.isfunction(func):
        raise ConfigurationError(
            f"@guarded got {func!r}, not a function: place @guarded under @task "
            "(@task() on the line above @guarded(...))"
        )
    params = list(inspect.signature(func).parameters.values())
    takes_context = bool(params) and params[0].name == "context"  # django.tasks' rule
    return GuardSpec.of(func, DJANGO_TASKS, options, skip_first=takes_context)


class _Actions(Actions):
    """django.tasks' side of a conflict in the run: a skipped run returns the marker;
    a retry enqueues a copy to run after the countdown (backends that can defer)."""

    def __init__(self, result: Any) -> None:
        self.result = result

    def can_retry(self) -> bool:
        return self.result is not None and bool(self.result.task.get_backend().supports_defer)

    def retry(self, countdown: float, error: AlreadyLocked) -> Any:
        result = self.result
        at = timezone.now() + timedelta(seconds=countdown)
        again = result.task.using(run_after=at).enqueue(*result.args, **result.kwargs)
        return {MARKER: DEFERRED, "task": result.task.module_path, "task_id": result.id,
                "key": error.key, "retry_id": again.id}  # fmt: skip


def _run(spec: GuardSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GuardedRun:
    """One guarded execution of the job this worker started (``None``: the function was
    called directly, e.g. inside another task's body, and is no job of its own)."""
    context_result = args[0].task_result if spec.skip_first and args else None
    result = context_result or _started.get(None)
    if result is not None and result.task.module_path != spec.name:
        result = None
    if spec.opts.locks_queue and result is not None:
        backend = result.task.get_backend()
        if not getattr(backend, "takes_queue_leases", False):
            raise ConfigurationError(
                f"task {spec.name}: lock='{spec.opts.lock}' needs the enqueue to take the lock: "
                f"set TASKS[{backend.alias!r}]['BACKEND'] to "
                "'taskguard.contrib.django_tasks.GuardedBackend' (the current backend "
                "in its OPTIONS), or use lock='run'"
            )
    task_id = result.id if result is not None else None
    return GuardedRun(
        spec, project_settings(), args, kwargs, task_id=task_id, actions=_Actions(result)
    )


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
                return await _run(spec, args, kwargs).arun(lambda: f(*args, **kwargs))

            wrapper: Any = run_async
        else:

            @functools.wraps(f)
            def run_sync(*args: Any, **kwargs: Any) -> Any:
                return _run(spec, args, kwargs).run(lambda: f(*args, **kwargs))

            wrapper = run_sync
        wrapper.taskguard = spec
        return wrapper

    return decorate(func) if func is not None else decorate
