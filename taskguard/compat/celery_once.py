"""celery-once's lock store in taskguard's table: ``QueueOnce`` tasks keep working,
their locks become rows (docs/migrating-from-celery-once.md)::

    app.conf.ONCE = {
        "backend": "taskguard.compat.celery_once.Backend",
        "settings": {"url": "postgresql://…", "default_timeout": 3600},
    }

Without ``url``: the app's ``taskguard_database_url`` (else ``$TASKGUARD_DATABASE_URL``).
``blocking`` / ``blocking_timeout`` wait for the key as celery-once's Redis backend does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from taskguard.compat import (
    DEFAULT_EXPIRY,
    calling_task_name,
    configuring_app,
    end_live_lease,
)
from taskguard.config import guard_for
from taskguard.exceptions import ConfigurationError
from taskguard.guard import TaskGuard

try:
    from celery_once.tasks import AlreadyQueued  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - only without the peer installed
    raise ImportError(
        f"taskguard.compat.celery_once is celery-once's backend: pip install celery-once ({exc})"
    ) from exc

__all__ = ["Backend"]


#: The app whose ``ONCE["settings"]`` is a given settings mapping (by identity).
_APPS: dict[int, tuple[Mapping[str, Any], Any]] = {}


class Backend:
    """What ``QueueOnce`` calls: :meth:`raise_or_lock` when a call is published,
    :meth:`clear_lock` when its run ends.

    celery-once builds its backend again on every publish and every run: this only
    looks up the process's guard for the URL (one engine per URL per process), and
    the app whose ``ONCE`` setting it was built from (in any thread)."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        url = settings.get("url")
        # celery-once builds a backend per publish: the app is looked up once per settings.
        known = _APPS.get(id(settings))
        if known is None or known[0] is not settings:
            found = configuring_app(
                lambda conf: (conf.get("ONCE") or {}).get("settings") is settings
            )
            known = _APPS[id(settings)] = (settings, found)
        self._app = known[1]
        self._url = None if url is None else str(url)
        self._timeout: float = settings.get("default_timeout") or DEFAULT_EXPIRY
        self._wait: float | None = None
        if settings.get("blocking"):
            wait = settings.get("blocking_timeout", 1)
            if isinstance(wait, bool) or not isinstance(wait, (int, float)):
                raise ConfigurationError(
                    f"ONCE settings: blocking_timeout must be a number of seconds, got {wait!r} "
                    "(taskguard never waits without a limit)"
                )
            self._wait = float(wait)
        try:
            self.guard  # noqa: B018 - a wrong URL (celery-once's redis:// left in) fails here
        except ConfigurationError as exc:
            raise ConfigurationError(f"ONCE settings url: {exc}") from None

    @property
    def guard(self) -> TaskGuard:
        """The process's :class:`~taskguard.TaskGuard` for this backend's URL."""
        return guard_for(self._app, url=self._url)

    def raise_or_lock(self, key: str, timeout: float | None) -> None:
        """Take ``key`` for ``timeout`` seconds by the database clock, or raise
        ``AlreadyQueued`` with the seconds its holder has left (the conflict is
        logged with the holder). ``timeout=None`` means ``default_timeout`` (one
        hour without it), not a lock that never expires."""
        ttl = self._timeout if timeout is None else timeout
        lease, holder = self.guard.try_acquire(
            key, ttl, wait=self._wait, task_name=calling_task_name(self._app, key)
        )
        if lease is None:
            left = holder.expires_in.total_seconds() if holder is not None else 0.0
            raise AlreadyQueued(max(left, 0.0))

    def clear_lock(self, key: str) -> None:
        """End ``key``'s live lease, whoever took it (celery-once takes the lock
        before the task has an id, so the run that ends cannot be told from another)."""
        end_live_lease(self.guard, key)
