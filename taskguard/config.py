"""Settings, read the Celery way: ``app.conf.taskguard_*`` first, then the
environment. One :class:`TaskGuard` (one engine, one small pool) per process and
URL, created lazily; TaskGuard's own engines drop inherited connections after a
fork, so prefork children never share a socket with the parent.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

from taskguard.exceptions import ConfigurationError
from taskguard.guard import TaskGuard

__all__ = ["DEFAULTS", "ENV_DATABASE_URL", "database_url", "guard_for", "reset_guards", "setting"]

ENV_DATABASE_URL = "TASKGUARD_DATABASE_URL"

#: Every ``taskguard_*`` setting and its default.
DEFAULTS: dict[str, Any] = {
    "taskguard_database_url": None,
    #: Lease length when a task does not say (seconds); renewed every ttl/3 while it runs.
    "taskguard_default_ttl": 300.0,
    #: False: PostgreSQL synchronous_commit=off for lock statements (see docs/reliability.md).
    "taskguard_durable": True,
    #: Extra keyword arguments for sqlalchemy.create_engine.
    "taskguard_engine_options": {},
    #: Reaper: delete rows whose lease ended more than this many seconds ago.
    "taskguard_reaper_grace": 300.0,
    "taskguard_reaper_batch_size": 5000,
    #: Seconds between reaper runs. When set, importing taskguard puts the reaper on the
    #: beat schedule of every app that has it (otherwise call taskguard.schedule_reaper(app)).
    "taskguard_reaper_interval": None,
    #: Record grants, conflicts, releases and losses in task_lock_events (taskguard explain).
    "taskguard_history": False,
    #: Seconds of history the reaper keeps.
    "taskguard_history_retention": 604800.0,
    #: Longest wait of on_conflict="wait" tasks that do not set wait_timeout (seconds).
    "taskguard_wait_timeout": 300.0,
}

_guards: dict[tuple[str, bool, bool, float], TaskGuard] = {}
_guards_lock = threading.Lock()
# The guard each app resolved to. Reading four settings through Celery's layered
# conf on every task run cost more CPU than the lock statements' own Python work;
# reset_guards() empties this, so changed settings are read again.
_by_app: weakref.WeakKeyDictionary[Any, TaskGuard] = weakref.WeakKeyDictionary()


def setting(app: Any, name: str) -> Any:
    """``app.conf[name]`` if set, else the default from :data:`DEFAULTS`."""
    if name not in DEFAULTS:
        raise ConfigurationError(f"unknown taskguard setting {name!r}")
    conf = getattr(app, "conf", None) if app is not None else None
    value = conf.get(name) if conf is not None else None
    return DEFAULTS[name] if value is None else value


def database_url(app: Any = None) -> str:
    """The lock database URL: ``app.conf.taskguard_database_url``, else
    ``$TASKGUARD_DATABASE_URL``; a :class:`ConfigurationError` naming both if neither is set."""
    url = setting(app, "taskguard_database_url") or os.environ.get(ENV_DATABASE_URL)
    if not url:
        raise ConfigurationError(
            "taskguard has no database URL: set app.conf.taskguard_database_url "
            f"or the {ENV_DATABASE_URL} environment variable"
        )
    return str(url)


def guard_for(app: Any = None) -> TaskGuard:
    """The process-wide :class:`TaskGuard` for ``app``'s configuration.

    An app's settings are read on its first use in a process; call
    :func:`reset_guards` after changing them."""
    if app is not None:
        try:
            return _by_app[app]
        except (KeyError, TypeError):
            pass
    guard = _resolve(app)
    if app is not None:
        with contextlib.suppress(TypeError):  # not weak-referenceable: resolve each time
            _by_app[app] = guard
    return guard


def _resolve(app: Any) -> TaskGuard:
    url = database_url(app)
    durable = bool(setting(app, "taskguard_durable"))
    history = bool(setting(app, "taskguard_history"))
    retention = float(setting(app, "taskguard_history_retention"))
    key = (url, durable, history, retention)
    guard = _guards.get(key)
    if guard is not None:
        return guard
    with _guards_lock:
        guard = _guards.get(key)
        if guard is None:
            options = dict(setting(app, "taskguard_engine_options") or {})
            guard = TaskGuard(
                url, durable=durable, history=history, history_retention=retention, **options
            )
            _guards[key] = guard
        return guard


def reset_guards() -> None:
    """Dispose every cached guard (tests, or after changing settings)."""
    with _guards_lock:
        _by_app.clear()
        for guard in _guards.values():
            guard.dispose()
        _guards.clear()
