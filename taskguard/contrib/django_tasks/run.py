"""``@guarded``: the run-time lock of a django.tasks task, for any backend.

Placed under ``@task``, it wraps the function every worker backend calls: the key
comes from the bound arguments (taskguard's :class:`~taskguard.keys.KeyDeriver`),
the lease is renewed while the body runs (the Celery layer's heartbeat), released
by its owner at the end, and a conflict is skipped, raised, waited out or deferred
(``on_conflict``). A run whose job was enqueued through
:class:`~taskguard.contrib.django_tasks.GuardedBackend` adopts the lease its
enqueue took.
"""

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
from taskguard.exceptions import AlreadyLocked, ConfigurationError, TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.holding import Hold, enter_run, exit_run
from taskguard.keys import KeyDeriver, KeyOption, validate_limit, validate_ttl
from taskguard.lease import MARKER, Lease, LockInfo, skipped_result

__all__ = ["DEFERRED", "LOCK_PHASES", "ON_CONFLICT", "GuardSpec", "guarded", "project_guard"]

log = logging.getLogger("taskguard.django_tasks")

LOCK_PHASES = ("run", "queue", "queue_and_run")
#: What a run does when its key is held ("existing" applies at enqueue only).
ON_CONFLICT = ("skip", "raise", "retry", "wait", "existing")
#: ``value[MARKER]`` of a run put back in the queue by ``on_conflict="retry"``.
DEFERRED = "deferred"

# The TaskResult the worker is about to run in this context (task_started is sent
# by every worker backend just before it calls the function).
_started: contextvars.ContextVar[Any] = contextvars.ContextVar("taskguard_task_result")


def _on_started(sender: Any, task_result: Any, **_: Any) -> None:
    _started.set(task_result)


def _on_finished(sender: Any, task_result: Any, **_: Any) -> None:
    _started.set(None)


task_started.connect(_on_started, dispatch_uid="taskguard.django_tasks.started")
task_finished.connect(_on_finished, dispatch_uid="taskguard.django_tasks.finished")


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
    """A guarded task's options, checked when the task is defined."""

    name: str
    keys: KeyDeriver
    takes_context: bool
    lock: str = "run"
    on_conflict: str = "skip"
    ttl: float | None = None
    queue_ttl: float | None = None
    limit: int = 1
    wait_timeout: float | None = None
    retry_countdown: float | None = None

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return self.keys.derive(args[1:] if self.takes_context else args, kwargs)

    def lease_ttl(self) -> float:
        return self.ttl or float(setting(_settings(), "taskguard_default_ttl"))


def _spec(func: Callable[..., Any], options: dict[str, Any]) -> GuardSpec:
    name = f"{func.__module__}.{func.__qualname__}"
    signature = inspect.signature(func)
    params = list(signature.parameters.values())
    takes_context = bool(params) and params[0].name == "context"  # django.tasks' rule
    if takes_context:
        signature = signature.replace(parameters=params[1:])
    key: KeyOption = options.pop("key", None)
    keys = KeyDeriver(name, signature, key, options.pop("key_args", None))
    lock, on_conflict = options.get("lock", "run"), options.get("on_conflict", "skip")
    if lock not in LOCK_PHASES:
        raise ConfigurationError(f"task {name}: lock={lock!r} is not one of {LOCK_PHASES}")
    if on_conflict not in ON_CONFLICT:
        raise ConfigurationError(
            f"task {name}: on_conflict={on_conflict!r} is not one of {ON_CONFLICT}"
        )
    if on_conflict == "existing" and lock == "run":
        raise ConfigurationError(
            f"task {name}: on_conflict='existing' answers a duplicate enqueue with the "
            "queued job's result: use lock='queue' or 'queue_and_run' (and GuardedBackend)"
        )
    try:
        for seconds in ("ttl", "queue_ttl", "wait_timeout", "retry_countdown"):
            if options.get(seconds) is not None:
                options[seconds] = validate_ttl(options[seconds], name=seconds)
        validate_limit(options.get("limit", 1), 0)
    except TaskGuardError as exc:
        raise ConfigurationError(f"task {name}: {exc}") from None
    known = {f for f in GuardSpec.__dataclass_fields__ if f not in ("name", "keys")}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigurationError(
            f"task {name}: unknown option(s) {', '.join(unknown)}; "
            f"options: key, key_args, {', '.join(sorted(known - {'takes_context'}))}"
        )
    return GuardSpec(name, keys, takes_context, **options)


class _Run:
    """One guarded execution: takes (or adopts) the lease, renews it while the body
    runs, releases it after. ``outcome`` is set instead when the body must not run."""

    def __init__(self, spec: GuardSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.spec = spec
        context_result = args[0].task_result if spec.takes_context and args else None
        result = context_result or _started.get(None)
        # (a guarded function called directly inside another task's body is not that job)
        self.result = (
            result if result is not None and result.task.module_path == spec.name else None
        )
        self.task_id: str | None = self.result.id if self.result is not None else None
        self.key = spec.key(args, kwargs)
        self.guard = project_guard()
        self.outcome: Any = None
        self.active: Hold | None = None

    def begin(self) -> Hold | None:
        """Take the lease: the run to enter, or ``None`` when the body must not run
        (then ``outcome`` is what the task returns)."""
        spec, guard, ttl = self.spec, self.guard, self.spec.lease_ttl()
        if spec.lock != "run" and self.result is not None:
            backend = self.result.task.get_backend()
            if not getattr(backend, "takes_queue_leases", False):
                raise ConfigurationError(
                    f"task {spec.name}: lock={spec.lock!r} needs the enqueue to take the lock: "
                    f"set TASKS[{backend.alias!r}]['BACKEND'] to "
                    "'taskguard.contrib.django_tasks.GuardedBackend' (the current backend "
                    "in its OPTIONS), or use lock='run'"
                )
        lease = self._adopt(ttl) if spec.lock != "run" else None
        if spec.lock == "queue":
            if lease is not None:
                guard.release(lease)
            # The queue lease ends when the run starts; the run holds none.
            self.active = Hold(guard, self.key, None, None)
            return self.active
        if lease is None:
            wait = None
            if spec.on_conflict == "wait":
                default = float(setting(_settings(), "taskguard_wait_timeout"))
                wait = spec.wait_timeout or default
            lease, holder = guard.try_acquire(
                self.key,
                ttl,
                limit=spec.limit,
                wait=wait,
                task_name=spec.name,
                task_id=self.task_id,
            )
            if lease is None:
                self.outcome = self._conflict(holder)
                return None
        self.active = Hold(guard, self.key, lease, None)
        self.active.task_id = self.task_id
        self.active.start_renewing()
        return self.active

    def _adopt(self, ttl: float) -> Lease | None:
        # The lease GuardedBackend took for this job at enqueue (its holder names the job).
        rows = self.guard.get_all(self.key)
        mine = [
            r
            for r in rows
            if r.held
            and r.holder.task_name == self.spec.name
            and r.holder.task_id in (None, self.task_id)
        ]
        if self.task_id is None or not mine:
            return None
        row = mine[0]
        return self.guard.adopt(
            self.key,
            row.owner,
            ttl,
            slot=row.slot,
            exclusive=True,
            task_name=self.spec.name,
            task_id=self.task_id,
        )

    def _conflict(self, holder: LockInfo | None) -> Any:
        spec = self.spec
        who = holder.describe() if holder is not None else "a holder that just released"
        if spec.on_conflict == "raise":
            raise AlreadyLocked(self.key, holder)
        if spec.on_conflict == "retry" and self.result is not None:
            task = self.result.task
            if task.get_backend().supports_defer:
                left = holder.expires_in.total_seconds() if holder is not None else 1.0
                countdown = spec.retry_countdown or max(left, 0.1)
                at = timezone.now() + timedelta(seconds=countdown)
                again = task.using(run_after=at).enqueue(*self.result.args, **self.result.kwargs)
                log.info(
                    "task %s (%s): lock %r held by %s; deferred %.1fs as %s",
                    spec.name,
                    self.task_id,
                    self.key,
                    who,
                    countdown,
                    again.id,
                )
                return {
                    MARKER: DEFERRED,
                    "task": spec.name,
                    "task_id": self.task_id,
                    "key": self.key,
                    "retry_id": again.id,
                }
            log.warning(
                "task %s: on_conflict='retry' but backend %r cannot defer a job; skipped",
                spec.name,
                task.backend,
            )
        log.warning(
            "task %s (%s) skipped: lock %r is held by %s", spec.name, self.task_id, self.key, who
        )
        return skipped_result(
            task=spec.name, task_id=self.task_id, key=self.key, phase="run", holder=holder
        )

    def end(self) -> None:
        if self.active is None or self.active.lease is None:
            return
        assert self.active is not None
        self.active.stop_renewing()
        if not self.guard.release(self.active.lease):
            log.warning(
                "task %s: lease on %r had expired or been taken over at release",
                self.spec.name,
                self.key,
            )


def guarded(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Lock a django.tasks task per key while it runs; place it under ``@task``::

        @task()
        @guarded(key="feed:{url}", ttl=60)
        def import_feed(url): ...

    Options (as ``@guarded_task``'s): ``key`` / ``key_args``, ``ttl`` (default
    ``TASKGUARD_DEFAULT_TTL``), ``limit``, ``on_conflict`` (``"skip"``: return
    taskguard's skipped marker; ``"raise"``: fail with :class:`~taskguard.AlreadyLocked`;
    ``"wait"``: up to ``wait_timeout``; ``"retry"``: enqueue again after
    ``retry_countdown`` where the backend can defer), and for
    :class:`GuardedBackend`: ``lock`` (``"run"``, ``"queue"``, ``"queue_and_run"``),
    ``queue_ttl``. The body reads its lease (fencing token) with
    :func:`~taskguard.contrib.django_tasks.current_lease`. docs/django-tasks.md.
    """

    def decorate(f: Callable[..., Any]) -> Any:
        spec = _spec(f, dict(options))
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                run = _Run(spec, args, kwargs)
                active = await asyncio.to_thread(run.begin)
                if active is None:
                    return run.outcome
                token = enter_run(active)  # in the body's own context
                try:
                    return await f(*args, **kwargs)
                finally:
                    exit_run(token)
                    await asyncio.to_thread(run.end)

            run_async.taskguard = spec  # type: ignore[attr-defined]
            return run_async

        @functools.wraps(f)
        def run_sync(*args: Any, **kwargs: Any) -> Any:
            run = _Run(spec, args, kwargs)
            active = run.begin()
            if active is None:
                return run.outcome
            token = enter_run(active)
            try:
                return f(*args, **kwargs)
            finally:
                exit_run(token)
                run.end()

        run_sync.taskguard = spec  # type: ignore[attr-defined]
        return run_sync

    return decorate(func) if func is not None else decorate
