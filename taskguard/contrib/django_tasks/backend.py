""":class:`GuardedBackend`: enqueue-time deduplication around any django.tasks backend.

Set in ``TASKS`` with the real backend's settings as its ``OPTIONS``; the object
Django gets is the real backend's class with :class:`GuardedBackend` in front, so
the real backend's worker (e.g. django-tasks-db's ``db_worker``, which insists on
its own backend class) runs its jobs as before.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from asgiref.sync import sync_to_async
from django.utils.module_loading import import_string

from taskguard.contrib.django_tasks.framework import BaseTaskBackend
from taskguard.contrib.django_tasks.run import guarded, project_guard, project_settings
from taskguard.exceptions import AlreadyLocked, ConfigurationError
from taskguard.options import OPTION_NAMES
from taskguard.runs import Actions, GuardSpec, enqueue_locked

__all__ = ["GuardedBackend"]


class GuardedBackend(BaseTaskBackend):  # type: ignore[misc,unused-ignore]
    """``TASKS = {"default": {"BACKEND": "taskguard.contrib.django_tasks.GuardedBackend",
    "OPTIONS": {<the real backend's settings>}}}``: a ``lock="queue"``/``"queue_and_run"``
    task takes its key at enqueue (for ``queue_ttl``); a duplicate enqueue raises
    :class:`~taskguard.AlreadyLocked`, or with ``on_conflict="existing"`` returns the
    queued job's result; the job's run adopts the lease. Other tasks pass through."""

    #: What a guarded run checks before it relies on a lease taken at enqueue.
    takes_queue_leases = True

    def __new__(cls, alias: str, params: dict[str, Any]) -> Any:
        if cls is not GuardedBackend:
            return super().__new__(cls)
        path = (params.get("OPTIONS") or {}).get("BACKEND")
        if not isinstance(path, str):
            raise ConfigurationError(
                f"TASKS[{alias!r}]: GuardedBackend needs the real backend's settings as its "
                "OPTIONS, e.g. {'BACKEND': 'django_tasks_db.DatabaseBackend'}"
            )
        return super().__new__(_in_front_of(import_string(path)))

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        # Django passes GuardedBackend's settings; the real backend gets its own.
        super().__init__(alias=alias, params=params.get("OPTIONS") or {})

    async def aenqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        # Some backends' own aenqueue does not go through enqueue (django-tasks-db's).
        if _queue_locked(task) is None:
            return await super().aenqueue(task, args, kwargs)
        return await sync_to_async(self.enqueue, thread_sensitive=True)(task, args, kwargs)

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        spec = _queue_locked(task)
        if spec is None:
            return super().enqueue(task, args, kwargs)  # type: ignore[safe-super,unused-ignore]
        publish = super().enqueue  # type: ignore[safe-super,unused-ignore]
        return enqueue_locked(
            spec, project_settings(), args, kwargs, lambda: publish(task, args, kwargs),
            job_id=lambda result: str(result.id), actions=_Answers(self, task),
            guard=project_guard(),
        )  # fmt: skip


class _Answers(Actions):
    """A duplicate enqueue: answered with the queued job's result (``existing``), else
    refused (an enqueue has no skipped result to return)."""

    def __init__(self, backend: Any, task: Any) -> None:
        self.backend, self.task = backend, task

    def skip(self, value: dict[str, Any], error: AlreadyLocked) -> Any:
        raise error

    def retry(self, countdown: float, error: AlreadyLocked) -> Any:
        raise error

    def existing(self, job_id: str) -> Any:
        answer = self.backend.get_result(job_id)
        if answer.task is None:  # a backend that cannot tell a queued job's task
            object.__setattr__(answer, "task", self.task)
        return answer


def _queue_locked(task: Any) -> GuardSpec | None:
    spec: GuardSpec | None = getattr(task.func, "taskguard", None)
    return spec if spec is not None and spec.opts.locks_queue else None


@functools.cache
def _in_front_of(backend_class: type[Any]) -> type[Any]:
    """``backend_class`` with GuardedBackend in front, and a task class that accepts
    taskguard's options as ``@task(...)`` keyword arguments."""
    base_task = backend_class.task_class

    def __post_init__(self: Any) -> None:
        options = {n: getattr(self, n) for n in OPTION_NAMES if getattr(self, n) is not None}
        if options and not hasattr(self.func, "taskguard"):
            object.__setattr__(self, "func", guarded(self.func, **options))
        base_task.__post_init__(self)

    namespace = {
        "__post_init__": __post_init__,
        "__module__": __name__,
        "__annotations__": dict.fromkeys(OPTION_NAMES, "Any"),
    }
    namespace.update(dict.fromkeys(OPTION_NAMES))
    kwargs = {"frozen": True, "kw_only": True, "slots": "__slots__" in vars(base_task)}
    task_class: type[Any] = dataclasses.dataclass(**kwargs)(
        type("TaskWithGuardOptions", (base_task,), namespace)
    )
    name = f"Guarded{backend_class.__name__}"
    return type(name, (GuardedBackend, backend_class), {"task_class": task_class})
