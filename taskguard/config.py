"""Settings, read the Celery way: ``app.conf.taskguard_*`` first, then the
environment, and the one place a :class:`TaskGuard` is built from them.

:func:`build_guard` is the factory (every setting honoured); the Celery glue,
the reaper and the demo share one cached guard per process and configuration
through :func:`guard_for`, the command line builds a short-lived one per command.
TaskGuard's own engines drop inherited connections after a fork, so prefork
children never share a socket with the parent.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from taskguard.compat import backend_url
from taskguard.exceptions import ConfigurationError
from taskguard.guard import TaskGuard

__all__ = [
    "DEFAULTS",
    "ENV_DATABASE_URL",
    "build_guard",
    "database_url",
    "guard_for",
    "reset_guards",
    "setting",
    "unknown_settings",
]

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
    # -- Celery glue (taskguard.celery) --------------------------------------------------
    #: Seconds a finished task id is remembered: a copy of its message delivered within
    #: this window is dropped (taskguard.celery.lease_calls). Keep it above the broker's
    #: redelivery window (Redis/SQS visibility_timeout) plus the longest task. 0: off.
    "taskguard_finished_retention": 7200.0,
    #: Seconds a guarded run that cannot reach the lock database before its body starts
    #: keeps being published again with a backoff (1 s doubling to 30 s, outside
    #: max_retries), counted from its first failure; then it fails. 0: fail at once.
    "taskguard_outage_retry_for": 300.0,
    # -- production PostgreSQL: poolers, standbys, time limits (docs/operations.md) --
    #: Seconds one lease operation may take (client-side; the connection is shut down,
    #: never the statement cancelled); then OutcomeUnknown / DatabaseUnavailable.
    "taskguard_call_timeout": 10.0,
    #: A direct or session-pooled URL of the lock database for wait= wake-ups
    #: (LISTEN). Unset: the lock URL, unless it goes through a pooler (then: polling).
    "taskguard_listen_url": None,
    #: Worker start-up check (URL, connectivity, schema at head, privileges):
    #: "stop" (stop the worker on a wrong URL, an old schema or a missing privilege;
    #: only log an unreachable database), "strict" (stop on anything), "log", "off".
    "taskguard_startup_check": "stop",
}

_guards: dict[tuple[Any, ...], TaskGuard] = {}
_guards_lock = threading.Lock()


def _reset_lock_after_fork() -> None:
    # A child forked while another thread held the lock would wait on it forever.
    global _guards_lock  # noqa: PLW0603 (the lock itself must be replaced)
    _guards_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)
# The guard each app resolved to. Reading four settings through Celery's layered
# conf on every task run cost more CPU than the lock statements' own Python work;
# reset_guards() empties this, so changed settings are read again.
_by_app: weakref.WeakKeyDictionary[Any, TaskGuard] = weakref.WeakKeyDictionary()
# The same, per lock database URL named by the caller (guard_for(app, url=...)).
_by_app_url: weakref.WeakKeyDictionary[Any, dict[str, TaskGuard]] = weakref.WeakKeyDictionary()


def setting(app: Any, name: str) -> Any:
    """``app.conf[name]`` if set, else the default from :data:`DEFAULTS`."""
    if name not in DEFAULTS:
        raise ConfigurationError(f"unknown taskguard setting {name!r}")
    conf = getattr(app, "conf", None) if app is not None else None
    value = conf.get(name) if conf is not None else None
    return DEFAULTS[name] if value is None else value


def database_url(app: Any = None, explicit: str | None = None) -> str:
    """Which database ``app``'s taskguard uses, read one way by the workers, the start-up
    check, the reaper, the command line and Django: ``explicit`` (a ``--database-url``),
    else the app's configuration (``taskguard_database_url``, else the URL its compat
    backend is given, as the migration guides set it), else ``$TASKGUARD_DATABASE_URL``.
    A :class:`ConfigurationError` naming the settings (and a misspelled one) if none is set."""
    conf = getattr(app, "conf", None)
    url = explicit or setting(app, "taskguard_database_url")
    url = url or (backend_url(conf) if conf is not None else None)
    url = url or os.environ.get(ENV_DATABASE_URL)
    if not url:
        hints = "".join(f"; {hint}" for hint in unknown_settings(app))
        raise ConfigurationError(
            "taskguard has no database URL: set app.conf.taskguard_database_url "
            f"or the {ENV_DATABASE_URL} environment variable{hints}"
        )
    return str(url)


def unknown_settings(app: Any) -> list[str]:
    """One line per ``taskguard_*`` key of ``app``'s configuration that taskguard does
    not know, naming the closest known one."""
    conf = getattr(app, "conf", None)
    if conf is None:
        return []
    lines = []
    for name in sorted(k for k in conf if isinstance(k, str) and k not in DEFAULTS):
        if name.startswith("taskguard_"):  # upper case: Django's settings, checked by Django
            close = difflib.get_close_matches(name.lower(), list(DEFAULTS), n=1)
            hint = f"did you mean {close[0]}?" if close else "see taskguard.config.DEFAULTS"
            lines.append(f"unknown setting {name}: {hint}")
    return lines


@dataclass(frozen=True)
class _GuardSettings:
    url: str
    durable: bool
    history: bool
    history_retention: float
    call_timeout: float
    listen_url: str | None
    engine_options: dict[str, Any]

    def identity(self) -> tuple[Any, ...]:
        # Engine options are part of it: apps that tune their pools differently
        # must not share one engine.
        return (
            self.url,
            self.durable,
            self.history,
            self.history_retention,
            self.call_timeout,
            self.listen_url,
            repr(sorted(self.engine_options.items())),
        )


def _guard_settings(app: Any, url: str | None) -> _GuardSettings:
    return _GuardSettings(
        url=url or database_url(app),
        durable=bool(setting(app, "taskguard_durable")),
        history=bool(setting(app, "taskguard_history")),
        history_retention=float(setting(app, "taskguard_history_retention")),
        call_timeout=float(setting(app, "taskguard_call_timeout")),
        listen_url=setting(app, "taskguard_listen_url") or None,
        engine_options=dict(setting(app, "taskguard_engine_options") or {}),
    )


def build_guard(app: Any = None, *, url: str | None = None) -> TaskGuard:
    """A new :class:`TaskGuard` for ``app``'s settings (``taskguard_durable``,
    ``taskguard_history``, ``taskguard_history_retention``, ``taskguard_call_timeout``,
    ``taskguard_listen_url``, ``taskguard_engine_options``; defaults without an app).
    ``url`` overrides the configured database URL. The caller disposes it; processes
    that keep one use :func:`guard_for`."""
    s = _guard_settings(app, url)
    return TaskGuard(
        s.url,
        durable=s.durable,
        history=s.history,
        history_retention=s.history_retention,
        call_timeout=s.call_timeout,
        listen_url=s.listen_url,
        **s.engine_options,
    )


def guard_for(app: Any = None, *, url: str | None = None) -> TaskGuard:
    """The process-wide :class:`TaskGuard` for ``app``'s configuration, built by
    :func:`build_guard` on first use. ``url``: the same settings on that database
    instead of the configured one (the compat backends' own URL setting); one guard
    per configuration and URL, so a URL equal to the configured one shares its guard.

    An app's settings are read on its first use in a process; call
    :func:`reset_guards` after changing them."""
    try:
        if url is None:
            return _by_app[app]
    except (KeyError, TypeError):  # not built yet, or no app (None)
        pass
    if url is not None:
        return _guard_on(app, url)
    guard = _resolve(app)
    if app is not None:
        with contextlib.suppress(TypeError):  # not weak-referenceable: resolve each time
            _by_app[app] = guard
    return guard


def _guard_on(app: Any, url: str) -> TaskGuard:
    try:
        return _by_app_url[app][url]
    except (KeyError, TypeError):  # TypeError: no app, or not weak-referenceable
        pass
    guard = _resolve(app, url)
    with contextlib.suppress(TypeError):
        _by_app_url.setdefault(app, {})[url] = guard
    return guard


def _resolve(app: Any, url: str | None = None) -> TaskGuard:
    key = _guard_settings(app, url).identity()
    guard = _guards.get(key)
    if guard is not None:
        return guard
    with _guards_lock:
        guard = _guards.get(key)
        if guard is None:
            guard = build_guard(app, url=url)
            _guards[key] = guard
        return guard


def reset_guards() -> None:
    """Dispose every cached guard (tests, or after changing settings)."""
    with _guards_lock:
        _by_app.clear()
        _by_app_url.clear()
        for guard in _guards.values():
            guard.dispose()
        _guards.clear()
