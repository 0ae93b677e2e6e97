"""Lock stores for celery-once and celery-singleton: their tasks keep working
unchanged, their locks become rows of ``task_locks`` (docs/migrating-from-celery-once.md,
docs/migrating-from-celery-singleton.md).

Each backend is a thin layer over the process's :class:`~taskguard.TaskGuard` for its
URL (:func:`taskguard.config.guard_for`): one engine per URL per process, shared with
``@guarded_task``; a forked worker child opens its own connections. Neither peer is
imported until its backend module is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from taskguard.dialects import dialect_for
from taskguard.exceptions import ConfigurationError
from taskguard.guard import TaskGuard
from taskguard.lease import Lease, LockInfo
from taskguard.urls import parse_url
from taskguard.validation import MIN_TTL

__all__ = [
    "DEFAULT_EXPIRY",
    "backend_url",
    "calling_task_name",
    "configured",
    "configuring_app",
    "end_lease",
    "end_live_lease",
    "names_lock_database",
]

#: Seconds a lock lasts when the peer asks for one that never expires (celery-singleton's
#: ``expiry=None``, celery-once's ``timeout=None``): one hour, celery-once's default
#: timeout and the Redis broker's visibility timeout. A worker killed mid-task then
#: blocks its key for at most this long, instead of until someone deletes it.
DEFAULT_EXPIRY = 3600.0


def configured(conf: Any) -> dict[str, str | None]:
    """The peers whose lock store is taskguard's in this Celery configuration, each with
    the URL it is given (``ONCE["settings"]["url"]``, ``singleton_backend_url``) or
    ``None``: ``{"celery_once": ..., "celery_singleton": ...}``, absent peers left out."""
    found: dict[str, str | None] = {}
    once = conf.get("ONCE")
    if isinstance(once, dict) and _is_ours(once.get("backend")):
        found["celery_once"] = (once.get("settings") or {}).get("url")
    if _is_ours(conf.get("singleton_backend_class")):
        found["celery_singleton"] = conf.get("singleton_backend_url")
    return found


def _is_ours(backend: Any) -> bool:
    path = backend if isinstance(backend, str) else getattr(backend, "__module__", None)
    return isinstance(path, str) and path.startswith("taskguard.compat.")


def backend_url(conf: Any) -> str | None:
    """The lock database a compat backend of this configuration is given, if any."""
    urls = [url for url in configured(conf).values() if names_lock_database(url)]
    return str(urls[0]) if urls else None


def configuring_app(configures: Callable[[Any], bool]) -> Any:
    """The Celery app whose configuration built a backend: the peers hand their backends
    their own settings only, and ``celery.current_app`` is per thread (in a thread
    that did not make the app, an empty default one). The process's configured app
    whose ``conf`` ``configures`` accepts, the current one preferred; else the current
    app (a backend made by hand)."""
    from celery import current_app
    from celery._state import _get_active_apps

    current = current_app._get_current_object()
    if configures(current.conf):
        return current
    others = (a for a in list(_get_active_apps()) if a.configured and configures(a.conf))
    return next(others, current)


#: How many callers up the stack a backend method looks for the peer's task.
_CALLERS = 16


def calling_task_name(app: Any = None, key: str | None = None) -> str | None:
    """The name of the peer's task a backend method was called for, for its row: the
    peers hand their backends no task. celery-once's keys say it (``qo_<task name>_
    <arguments>``, :func:`celery_once.helpers.queue_once_key`): the longest name
    registered in ``app`` that the key starts with. Otherwise (celery-singleton's keys
    are digests) the nearest caller up the stack that is a method of a Celery task
    (``Singleton.aquire_lock``, ``QueueOnce.apply_async``, or a subclass's override or a
    wrapper of them, however deep)."""
    from celery import Task

    if app is not None and key is not None and key.startswith("qo_"):
        try:
            registered = app.tasks
        except RuntimeError:  # an app that is not finalized yet (autofinalize=False)
            registered = {}
        ends = [i for i, ch in enumerate(key) if ch == "_" and i > 3] + [len(key)]
        named = next((key[3:i] for i in reversed(ends) if key[3:i] in registered), None)
        if named is not None:
            return named
    frame = sys._getframe(1)
    for _ in range(_CALLERS):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, Task):
            return str(caller.name)
    return None


def names_lock_database(url: object) -> bool:
    """Whether ``url`` is a database URL taskguard keeps locks in (not a broker's)."""
    if not isinstance(url, str):
        return False
    try:
        dialect_for(parse_url(url).get_backend_name())
    except ConfigurationError:
        return False
    return True


def end_lease(guard: TaskGuard, info: LockInfo) -> bool:
    """End the lease ``info`` was read from, and only it: one taken since the read
    (by its owner id) is never touched. ``True`` if this call ended it."""
    lease = Lease(
        info.key,
        info.owner,
        info.token,
        info.acquired_at,
        info.expires_at,
        ttl=max(info.expires_in.total_seconds(), MIN_TTL),
        slot=info.slot,
    )
    return guard.release(lease)


def end_live_lease(guard: TaskGuard, key: str) -> LockInfo | None:
    """End ``key``'s live lease, whoever took it (the peers' ``DEL``, by owner id so
    it cannot end a lease taken after the read); the row it ended, or ``None``."""
    info = guard.get(key)
    if info is None or not info.held:
        return None
    return info if end_lease(guard, info) else None
