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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from taskguard.dialects import fence_statement
from taskguard.exceptions import ConfigurationError, LeaseLost

if TYPE_CHECKING:
    from taskguard.lease import Lease

__all__ = ["fence"]


def fence(lease: Lease, session: Session | Connection) -> int:
    """Check ``lease`` inside ``session``'s transaction; return its fencing token.

    ``session`` is a SQLAlchemy :class:`~sqlalchemy.orm.Session` or
    :class:`~sqlalchemy.engine.Connection` on the lock database, with the
    transaction whose writes the lease must protect (one is begun if none is).
    Raises :class:`~taskguard.LeaseLost` if the lease expired, was released or was
    taken over; let it propagate so the transaction rolls back.
    """
    if isinstance(session, Session):
        dialect = session.get_bind().dialect
    elif isinstance(session, Connection):
        dialect = session.dialect
    else:
        raise ConfigurationError(
            "fence() needs a SQLAlchemy Session or Connection with an open transaction, "
            f"not {type(session).__name__}"
        )
    try:
        stmt = fence_statement(dialect.name)
    except NotImplementedError as exc:
        raise ConfigurationError(str(exc)) from None
    token = session.execute(
        stmt, {"lease_key": lease.key, "lease_slot": lease.slot, "lease_owner": lease.owner}
    ).scalar()
    if token is None:
        raise LeaseLost(
            lease.key,
            lease.owner,
            "fence failed: the lease expired, was released or was taken over "
            "(checked by the database clock); this transaction must not commit",
        )
    return int(token)
