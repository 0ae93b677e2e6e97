""":class:`GuardedBackend`: enqueue-time deduplication around any django.tasks backend.

Set in ``TASKS`` with the real backend's settings as its ``OPTIONS``; the object
Django gets is the real backend's class with :class:`GuardedBackend` in front, so
the real backend's worker (e.g. django-tasks-db's ``db_worker``, which insists on
its own backend class) runs its jobs as before.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from asgiref.sync import sync_to_async
from django.utils.module_loading import import_string

from taskguard.contrib.django_tasks.framework import BaseTaskBackend, TaskResult
from taskguard.contrib.django_tasks.run import GuardSpec, guarded, project_guard
from taskguard.exceptions import AlreadyLocked, ConfigurationError, OutcomeUnknown
from taskguard.guard import TaskGuard
from taskguard.holding import release_when_reachable
from taskguard.lease import Lease, LockInfo, describe_holder
from taskguard.options import OPTION_NAMES, Conflict

__all__ = ["GuardedBackend"]

log = logging.getLogger("taskguard.django_tasks")

#: How long a duplicate waits for the enqueue that holds the key to name its job.
JOB_ID_WAIT = 5.0


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
        key, guard, ttl = (
            spec.opts.deriver.derive(args, kwargs),
            project_guard(),
            spec.durations().queue_ttl,
        )
        try:  # the holder names no job until the job exists: its run adopts such a lease too
            lease, holder = guard.try_acquire(
                key, ttl, task_name=spec.name, **spec.opts.acquire_options
            )
        except OutcomeUnknown as exc:  # it may land later: given back once the database answers
            now = datetime.now(timezone.utc)
            maybe = Lease(key, exc.owner, 0, now, now + timedelta(seconds=ttl), ttl)
            release_when_reachable(guard, [maybe], f"{spec.name}: enqueue failed", landing=True)
            raise
        if lease is None:
            job = _job_of(guard, key, spec, holder)
            if job is not None:  # on_conflict="existing": the queued job answers
                log.info("task %s: lock %r held by queued job %s; answering with it",
                         spec.name, key, job)  # fmt: skip
                answer = self.get_result(job)
                if answer.task is None:  # a backend that cannot tell a queued job's task
                    object.__setattr__(answer, "task", task)
                return answer
            raise AlreadyLocked(
                key,
                holder,
                f"task {spec.name}: not enqueued: a job for lock {key!r} is already queued or "
                f"running ({describe_holder(holder)})",
            )
        try:
            result: TaskResult = super().enqueue(task, args, kwargs)  # type: ignore[safe-super,unused-ignore]
        except BaseException:
            guard.release(lease)
            raise
        # Name the job on its lease (None: its run already adopted it).
        guard.adopt(key, lease.owner, ttl, slot=lease.slot, exclusive=True,
                    task_name=spec.name, task_id=result.id)  # fmt: skip
        return result


def _job_of(guard: TaskGuard, key: str, spec: GuardSpec, holder: LockInfo | None) -> str | None:
    """The queued job to answer a duplicate with (``on_conflict="existing"``), once
    the enqueue holding the key has named it (it may be between its acquire and its
    job's creation: waited for up to :data:`JOB_ID_WAIT`)."""
    if spec.opts.conflict is not Conflict.EXISTING:
        return None
    deadline = time.monotonic() + JOB_ID_WAIT
    while holder is not None and holder.holder.task_id is None and time.monotonic() < deadline:
        time.sleep(0.05)
        holder = next((r for r in guard.get_all(key) if r.held), None)
    return holder.holder.task_id if holder is not None else None


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
        type("GuardedTask", (base_task,), namespace)
    )
    name = f"Guarded{backend_class.__name__}"
    return type(name, (GuardedBackend, backend_class), {"task_class": task_class})
