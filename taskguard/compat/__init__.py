"""Lock stores for celery-once and celery-singleton: their tasks keep working
unchanged, their locks become rows of ``task_locks`` (docs/migrating-from-celery-once.md,
docs/migrating-from-celery-singleton.md).

Each backend is a thin layer over the process's :class:`~taskguard.TaskGuard` for its
URL (:func:`taskguard.config.guard_for`): one engine per URL per process, shared with
``@guarded_task``; a forked worker child opens its own connections. Neither peer is
imported until its backend module is.
"""

from __future__ import annotations

from typing import Any

from taskguard.dialects import dialect_for
from taskguard.exceptions import ConfigurationError
from taskguard.guard import TaskGuard
from taskguard.keys import MIN_TTL
from taskguard.lease import Lease, LockInfo
from taskguard.urls import parse_url

__all__ = ["DEFAULT_EXPIRY", "celery_app", "end_lease", "end_live_lease", "names_lock_database"]

#: Seconds a lock lasts when the peer asks for one that never expires (celery-singleton's
#: ``expiry=None``, celery-once's ``timeout=None``): one hour, celery-once's default
#: timeout and the Redis broker's visibility timeout. A worker killed mid-task then
#: blocks its key for at most this long, instead of until someone deletes it.
DEFAULT_EXPIRY = 3600.0


def celery_app() -> Any:
    """The current Celery app (the peers hand their backends no app)."""
    from celery import current_app

    return current_app._get_current_object()


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
