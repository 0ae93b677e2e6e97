"""celery-singleton's lock store in taskguard's table: ``Singleton`` tasks keep
working, their locks become rows (docs/migrating-from-celery-singleton.md)::

    app.conf.singleton_backend_class = "taskguard.compat.celery_singleton.Backend"
    app.conf.singleton_backend_url = "postgresql://…"

Without ``singleton_backend_url`` (celery-singleton then passes the Redis result
backend's or the broker's URL): the app's ``taskguard_database_url``. Nothing here
imports celery-singleton: it duck-types its ``BaseBackend``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from taskguard.compat import (
    DEFAULT_EXPIRY,
    calling_task_name,
    configured,
    configuring_app,
    end_lease,
    names_lock_database,
)
from taskguard.config import guard_for
from taskguard.exceptions import ConfigurationError
from taskguard.guard import TaskGuard

__all__ = ["Backend"]

log = logging.getLogger("taskguard")

#: The holder a refused lock() read, per thread: get() of the same key right after (as
#: celery-singleton answers a duplicate) uses it instead of reading it again.
_seen = threading.local()
_SEEN_FOR = 0.5

# clear(): live leases read and ended per round.
_CLEAR_BATCH = 1000


class Backend:
    """celery-singleton's backend interface: :meth:`lock` when a call is published,
    :meth:`unlock` when its run succeeds or fails, :meth:`get` for the task id a
    duplicate is answered with, :meth:`clear` for ``clear_locks(app)``."""

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        if kwargs:
            raise ConfigurationError(
                f"singleton_backend_kwargs {sorted(kwargs)} are Redis client options; "
                "taskguard's backend takes none: remove them (engine options go in "
                "taskguard_engine_options)"
            )
        # celery-singleton keeps this backend for the whole process: the app whose
        # configuration names it and this URL, whichever thread published first.
        self._app = configuring_app(
            lambda conf: (
                "celery_singleton" in configured(conf)
                and url
                in (conf.get(k) for k in ("singleton_backend_url", "result_backend", "broker_url"))
            )
        )
        explicit = self._app.conf.get("singleton_backend_url") is not None
        self._url = url if explicit or names_lock_database(url) else None
        try:
            self.guard  # noqa: B018 - a wrong URL fails here, naming the setting
        except ConfigurationError as exc:
            raise ConfigurationError(f"singleton_backend_url: {exc}") from None

    @property
    def guard(self) -> TaskGuard:
        """The process's :class:`~taskguard.TaskGuard` for this backend's URL."""
        return guard_for(self._app, url=self._url)

    def lock(self, lock: str, task_id: str, expiry: float | None = None) -> bool:
        """Take ``lock`` for task ``task_id`` for ``expiry`` seconds by the database
        clock; ``False`` if it is held (the conflict is logged with the holder).
        ``expiry=None`` means one hour (:data:`~taskguard.compat.DEFAULT_EXPIRY`),
        not a lock that never expires."""
        ttl = DEFAULT_EXPIRY if expiry is None else expiry
        attempt = self.guard.try_acquire(lock, ttl, task_name=calling_task_name(), task_id=task_id)
        if attempt.lease is None:  # celery-singleton asks get() for the holder next
            _seen.last = (lock, attempt.holder, time.monotonic())
        return attempt.lease is not None

    def unlock(self, lock: str) -> None:
        """End ``lock``'s live lease. Called by a running task for its own key, it
        ends only that task's lease: when the task outlived its expiry and another
        task took the key since, that lease is kept (logged as a warning)."""
        guard = self.guard
        info = guard.get(lock)
        if info is None or not info.held:
            return
        task = _running_task()
        if task is not None and info.holder.task_id != task.request.id and _own(task, lock):
            log.warning(
                "not releasing %r for task %s: its lease ended and the key is now held by %s",
                info.key,
                task.request.id,
                info.describe(),
            )
            return
        end_lease(guard, info)

    def get(self, lock: str) -> str | None:
        """The task id that holds ``lock`` now, or ``None``; the lease's owner id if
        its holder recorded no task id (taken outside celery-singleton): ``Singleton``
        asks again for as long as this is ``None`` while the lock is held."""
        seen, _seen.last = getattr(_seen, "last", None), None
        # The holder the refused lock() just read, in this thread, if any; else read now.
        if seen is not None and seen[0] == lock and time.monotonic() - seen[2] < _SEEN_FOR:
            info = seen[1] or self.guard.get(lock)
        else:
            info = self.guard.get(lock)
        if info is None or not info.held:
            return None
        return info.holder.task_id or info.owner

    def clear(self, key_prefix: str) -> None:
        """End every live lease whose key starts with ``key_prefix`` (compared as
        text: ``_`` and ``%`` are plain characters)."""
        guard = self.guard
        ended = 0
        while True:
            live = guard.held(key_prefix, limit=_CLEAR_BATCH)
            done = sum(end_lease(guard, info) for info in live)
            ended += done
            if len(live) < _CLEAR_BATCH or not done:
                break
        if ended:
            log.info("cleared %d celery-singleton lock(s) under %r", ended, key_prefix)


def _running_task() -> Any:
    """The task running in this thread, if it has an id (a worker's or an eager run)."""
    from celery import current_task

    task = current_task._get_current_object()
    return task if task is not None and task.request.id is not None else None


def _own(task: Any, lock: str) -> bool:
    """Whether ``lock`` is the running Singleton task's own key."""
    generate = getattr(task, "generate_lock", None)
    request = task.request
    return generate is not None and generate(task.name, request.args, request.kwargs) == lock
