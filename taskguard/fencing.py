"""Same-database fencing: prove, inside the task's own transaction, that its lease
is still held, so a paused or expired holder's commit fails instead of writing
stale data.

Unlike every other taskguard statement this one runs on the *caller's*
connection, in the caller's transaction: that is the point. Use it when the
task's business data lives in the lock database::

    with Session(engine) as session, session.begin():
        lease.fence(session)          # raises LeaseLost: nothing below commits
        session.add(Invoice(...))

On PostgreSQL the lease row is read ``FOR SHARE``: until the transaction ends, a
takeover (and the holder's own renewal) waits for it. So either the fence fails,
or the transaction commits while the lease is still the holder's. Fence in a READ
COMMITTED transaction, or as the first statement of a REPEATABLE READ/SERIALIZABLE
one (a row renewed after the snapshot was taken raises a serialization error).

On SQLite the fence takes the database's write lock for the rest of the
transaction (no other writer, hence no takeover, until it ends).

Django's ``django.db.connection`` works too, inside ``transaction.atomic()``: the
fence then runs through the connection's cursor, in the same transaction as the
ORM's writes.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Protocol

from sqlalchemy.dialects import registry
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from taskguard.dialects import dialect_for
from taskguard.dialects.base import compile_for
from taskguard.exceptions import ConfigurationError, LeaseLost

__all__ = ["LeaseRef", "fence"]

#: Django's connection.vendor -> SQLAlchemy backend name.
_DJANGO_VENDORS = {"postgresql": "postgresql", "sqlite": "sqlite", "mysql": "mysql"}


class LeaseRef(Protocol):
    """What fencing needs of a lease: which row, and whose."""

    @property
    def key(self) -> str: ...
    @property
    def slot(self) -> int: ...
    @property
    def owner(self) -> str: ...


def fence(lease: LeaseRef, session: Session | Connection | Any) -> int:
    """Check ``lease`` inside ``session``'s transaction; return its fencing token.

    ``session`` is a SQLAlchemy :class:`~sqlalchemy.orm.Session` or
    :class:`~sqlalchemy.engine.Connection` on the lock database, with the
    transaction whose writes the lease must protect (one is begun if none is), or
    Django's ``connection`` inside ``transaction.atomic()``.
    Raises :class:`~taskguard.LeaseLost` if the lease expired, was released or was
    taken over; let it propagate so the transaction rolls back.
    """
    params = {"lease_key": lease.key, "lease_slot": lease.slot, "lease_owner": lease.owner}
    if isinstance(session, Session):
        stmt = dialect_for(session.get_bind().dialect.name).fence_statement()
        token = session.execute(stmt, params).scalar()
    elif isinstance(session, Connection):
        token = session.execute(
            dialect_for(session.dialect.name).fence_statement(), params
        ).scalar()
    elif isinstance(getattr(session, "vendor", None), str) and hasattr(session, "cursor"):
        token = _fence_django(session, params)
    else:
        raise ConfigurationError(
            "fence() needs a SQLAlchemy Session or Connection, or Django's connection, "
            f"with an open transaction; not {type(session).__name__}"
        )
    if token is None:
        raise LeaseLost(
            lease.key,
            lease.owner,
            "fence failed: the lease expired, was released or was taken over "
            "(checked by the database clock); this transaction must not commit",
        )
    return int(token)


@cache
def _django_sql(vendor: str, paramstyle: str) -> tuple[str, tuple[str, ...] | None]:
    name = _DJANGO_VENDORS.get(vendor)
    if name is None:
        raise ConfigurationError(f"fence() does not support Django's {vendor!r} backend")
    # Only the SQL text is needed: compile for the backend's default dialect class.
    sa_dialect = registry.load(name)(paramstyle=paramstyle)
    compiled = compile_for(dialect_for(name).fence_statement(), sa_dialect)
    return compiled.sql, compiled.positional_names


def _fence_django(connection: Any, params: dict[str, Any]) -> Any:
    if not connection.in_atomic_block:
        raise ConfigurationError(
            "fence() with Django's connection must run inside transaction.atomic(): "
            "outside it each statement commits on its own and the fence protects nothing"
        )
    # Django's cursors take "%s" placeholders on every backend.
    sql, names = _django_sql(connection.vendor, "format")
    values = tuple(params[n] for n in names) if names else tuple(params.values())
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
        row = cursor.fetchone()
    return None if row is None else row[0]
