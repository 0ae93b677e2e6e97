"""The dialect registry: one module per database, each a
:class:`~taskguard.dialects.base.Dialect` (see docs/architecture.md, "Adding a
dialect").

:func:`dialect_for` names the dialect of an engine (every SQLAlchemy backend name
it answers to: MariaDB is ``mysql`` and ``mariadb``); :func:`dialect_for_url` also
checks that a URL names a driver taskguard supports there, installed;
:func:`lock_sql_for` compiles every statement for it once (cached per SQLAlchemy
dialect class and settings). Nothing outside this package branches on backend names.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from sqlalchemy import URL
from sqlalchemy.engine import Dialect as SADialect

from taskguard.dialects.base import RESERVE_GRACE, Dialect, LockSQL, Statement
from taskguard.dialects.mariadb import MariaDB
from taskguard.dialects.postgresql import PostgreSQL
from taskguard.dialects.sqlite import SQLite
from taskguard.dialects.statements import build_lock_sql
from taskguard.exceptions import ConfigurationError
from taskguard.models import UTCDateTime

__all__ = [
    "RESERVE_GRACE",
    "SUPPORTED_DIALECTS",
    "Dialect",
    "LockSQL",
    "Statement",
    "dialect_for",
    "dialect_for_url",
    "lock_sql_for",
    "registered",
]

_DIALECTS: tuple[Dialect, ...] = (PostgreSQL(), SQLite(), MariaDB())
_REGISTRY: dict[str, Dialect] = {name: d for d in _DIALECTS for name in (d.name, *d.aliases)}
# How each backend stores taskguard's timestamps (the tables know no dialect names).
UTCDateTime.naive_utc.update(
    {name: d.timestamp_type() for name, d in _REGISTRY.items() if d.naive_timestamps}
)

#: The supported databases, as messages name them.
SUPPORTED_DIALECTS: Sequence[str] = tuple(d.label for d in _DIALECTS)


def dialect_for(name: str) -> Dialect:
    """The dialect registered under SQLAlchemy backend ``name``; a
    :class:`~taskguard.ConfigurationError` naming the supported ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigurationError(
            f"taskguard supports {', '.join(SUPPORTED_DIALECTS)}; not {name!r}"
        ) from None


def dialect_for_url(url: URL) -> Dialect:
    """The dialect of ``url``'s backend, once the URL is known to name a driver
    taskguard supports there and that driver is installed; a one-line
    :class:`~taskguard.ConfigurationError` naming the supported ones otherwise."""
    dialect = dialect_for(url.get_backend_name())
    dialect.check_driver(url)
    return dialect


def registered() -> Sequence[Dialect]:
    """Every registered dialect."""
    return _DIALECTS


def lock_sql_for(sa_dialect: SADialect) -> LockSQL:
    """Every statement compiled for an engine's SQLAlchemy dialect, with positional
    parameters (``%s`` where the driver names them: psycopg then takes the tuple as
    it is, instead of reordering a dict on every call)."""
    if not sa_dialect.positional:
        sa_dialect = copy.copy(sa_dialect)
        sa_dialect.paramstyle, sa_dialect.positional = "format", True
    return build_lock_sql(dialect_for(sa_dialect.name), sa_dialect)
