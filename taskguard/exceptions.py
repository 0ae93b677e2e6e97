"""Every error taskguard raises derives from :class:`TaskGuardError`.

Subclasses carry the structured facts an operator or a retry policy needs (key,
holder, expiry) as attributes, so nobody has to parse a message string.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from taskguard.lease import LockInfo

__all__ = [
    "AlreadyLocked",
    "ConfigurationError",
    "DatabaseUnavailable",
    "InvalidKey",
    "InvalidTTL",
    "LeaseLost",
    "LockHeld",
    "OutcomeUnknown",
    "SchemaMissing",
    "TaskGuardError",
]


class TaskGuardError(Exception):
    """Base class of all taskguard errors."""


class ConfigurationError(TaskGuardError):
    """A required setting is missing or invalid; the message names the setting."""


class InvalidKey(TaskGuardError, ValueError):
    """A lock key cannot be stored (wrong type, empty, NUL, unencodable)."""

    def __init__(self, message: str, key: object) -> None:
        super().__init__(message)
        self.key = key


class InvalidTTL(TaskGuardError, ValueError):
    """A lease duration is not a positive, finite number of seconds in range."""

    def __init__(self, message: str, ttl: object) -> None:
        super().__init__(message)
        self.ttl = ttl


class LockHeld(TaskGuardError):
    """The key is held by someone else.

    ``holder`` describes the current holder as read right after the conflict (it
    can be ``None`` when the holder released between our attempt and the read).
    The exception's ``args`` are ``(key, None, message)`` so that it survives
    Celery's JSON result backend (which rebuilds exceptions as ``cls(*args)``):
    after such a round trip ``holder`` is ``None`` but the message still names it.
    """

    def __init__(
        self, key: str, holder: LockInfo | None = None, message: str | None = None
    ) -> None:
        self.key = key
        self.holder = holder
        self.expires_at: datetime | None = holder.expires_at if holder else None
        super().__init__(key, None, message or self._describe())

    def _describe(self) -> str:
        if self.holder is None:
            return f"lock {self.key!r} is held (holder released before it could be read)"
        return f"lock {self.key!r} is held by {self.holder.describe()}"

    def __str__(self) -> str:
        return str(self.args[2])

    def __reduce__(self) -> tuple[object, ...]:
        # pickle keeps the full holder; JSON transports use args (see class docstring).
        return (type(self), (self.key, self.holder, str(self)))


class AlreadyLocked(LockHeld):
    """Raised by ``@guarded_task`` with ``on_conflict="raise"``."""


class LeaseLost(TaskGuardError):
    """A lease expired or was taken over while its holder still believed it held it."""

    def __init__(self, key: str, owner: str, reason: str) -> None:
        self.key = key
        self.owner = owner
        self.reason = reason
        # All three in args: rebuilt as cls(*args) by Celery's JSON result backend.
        super().__init__(key, owner, reason)

    def __str__(self) -> str:
        return f"lease on {self.key!r} (owner {self.owner}) was lost: {self.reason}"


class DatabaseUnavailable(TaskGuardError):
    """The lock database could not be reached or the connection broke."""

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class OutcomeUnknown(DatabaseUnavailable):
    """The connection broke while a lock statement was in flight and the true
    outcome could not be read back. Treat the key as possibly held by ``owner``
    until ``expires_at`` at the latest (never assume you hold it)."""

    def __init__(self, message: str, key: str, owner: str, url: str | None = None) -> None:
        super().__init__(message, url)
        self.key = key
        self.owner = owner


class SchemaMissing(TaskGuardError):
    """taskguard's tables are not in the database: run ``taskguard db upgrade``."""
