"""Every error taskguard raises derives from :class:`TaskGuardError`.

Subclasses carry the structured facts an operator or a retry policy needs (key,
holder, expiry) as attributes, so nobody has to parse a message string.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol


class _Holder(Protocol):
    """What an error needs of a holder (a :class:`taskguard.LockInfo`)."""

    @property
    def expires_at(self) -> datetime: ...

    def describe(self) -> str: ...


__all__ = [
    "AlreadyLocked",
    "ConfigurationError",
    "DatabaseError",
    "DatabaseUnavailable",
    "InvalidArgument",
    "InvalidKey",
    "InvalidTTL",
    "LeaseLost",
    "LockHeld",
    "OutcomeUnknown",
    "PermissionDenied",
    "SchemaMissing",
    "TaskGuardError",
]


#: The one wording of a conflict's holder that was gone when it was read (it
#: released between the refused attempt and the read): see
#: :func:`taskguard.lease.describe_holder`.
HOLDER_GONE = "a holder that released before it could be read"


class TaskGuardError(Exception):
    """Base class of all taskguard errors.

    Subclasses pass every constructor argument to ``Exception.__init__`` (message
    first) so that pickle and Celery's JSON result backend, which rebuild an
    exception as ``cls(*args)``, give back the same type with the same fields.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


class ConfigurationError(TaskGuardError):
    """A required setting is missing or invalid; the message names the setting."""


class InvalidKey(TaskGuardError, ValueError):
    """A lock key cannot be stored (wrong type, empty, NUL, unencodable)."""

    def __init__(self, message: str, key: object) -> None:
        super().__init__(message, key)
        self.key = key


class InvalidTTL(TaskGuardError, ValueError):
    """A lease duration is not a positive, finite number of seconds in range."""

    def __init__(self, message: str, ttl: object) -> None:
        super().__init__(message, ttl)
        self.ttl = ttl


class InvalidArgument(TaskGuardError, ValueError):
    """A holder detail, slot or limit the lock table cannot store; ``name`` says which."""

    def __init__(self, message: str, name: str, value: object) -> None:
        super().__init__(message, name, value)
        self.name = name
        self.value = value


class LockHeld(TaskGuardError):
    """The key is held by someone else.

    ``holder`` describes the current holder as read right after the conflict (it
    can be ``None`` when the holder released between our attempt and the read).
    The exception's ``args`` are ``(key, None, message)`` so that it survives
    Celery's JSON result backend (which rebuilds exceptions as ``cls(*args)``):
    after such a round trip ``holder`` is ``None`` but the message still names it.
    """

    def __init__(self, key: str, holder: _Holder | None = None, message: str | None = None) -> None:
        self.key = key
        self.holder = holder
        self.expires_at: datetime | None = holder.expires_at if holder else None
        super().__init__(key, None, message or self._describe())

    def _describe(self) -> str:
        who = HOLDER_GONE if self.holder is None else self.holder.describe()
        return f"lock {self.key!r} is held by {who}"

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
    """The lock database could not be reached or the connection broke.

    ``statement_sent`` is ``False`` when no statement reached the server (the
    connection could not even be opened): the operation certainly did not happen.
    """

    def __init__(self, message: str, url: str | None = None, statement_sent: bool = True) -> None:
        super().__init__(message, url, statement_sent)
        self.url = url
        self.statement_sent = statement_sent


class OutcomeUnknown(DatabaseUnavailable):
    """The connection broke while a lock statement was in flight and the true
    outcome could not be read back. Treat the key as possibly held by ``owner``
    until its ttl ends at the latest (never assume you hold it)."""

    def __init__(self, message: str, key: str, owner: str, url: str | None = None) -> None:
        super().__init__(message, url)
        self.args = (message, key, owner, url)
        self.key = key
        self.owner = owner


class PermissionDenied(TaskGuardError):
    """The database role lacks a privilege on taskguard's objects (see
    docs/reliability.md, "Least privilege"); the message names the object."""

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message, url)
        self.url = url


class DatabaseError(TaskGuardError):
    """A lock statement was refused by the database for a reason other than an
    outage, a missing schema or a missing privilege (the message has the driver's)."""

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message, url)
        self.url = url


class SchemaMissing(TaskGuardError):
    """taskguard's tables are not in the database: run ``taskguard db upgrade``."""
