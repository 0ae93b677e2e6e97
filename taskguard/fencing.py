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

The release of a fenced lease needs that row too, so it cannot end the lease until
the fenced transaction ends. The fence remembers that transaction by the lease's
owner id (:data:`FENCED`; the transaction held weakly); a release called while it
is still open, on the thread that fenced, is done right after it ends, committed or
rolled back (a Session's ``after_transaction_end`` event; Django's ``on_commit``,
and the same hook dropped by a rollback), instead of waiting for its own row lock
until the call timeout. A Core :class:`~sqlalchemy.engine.Connection` has no hook
after its commit: that release is refused at once
(:class:`~taskguard.ConfigurationError`) and the transaction is left as it was. The
deferred release is by owner id like any other: it never ends a lease that has
passed to someone else.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from functools import cache
from typing import Any, Protocol

from sqlalchemy import event
from sqlalchemy.dialects import registry
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, SessionTransaction

from taskguard.dialects import dialect_for
from taskguard.dialects.base import compile_for
from taskguard.exceptions import ConfigurationError, LeaseLost

__all__ = ["fence"]

log = logging.getLogger("taskguard")

#: Leases fenced in a transaction that may still be open, by owner id: their release
#: waits for its end. An entry goes with its release, or with the next fence once its
#: transaction has ended (a lease never released).
FENCED: dict[str, Fenced] = {}

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
    fenced: Fenced
    if isinstance(session, Session):
        stmt = dialect_for(session.get_bind().dialect.name).fence_statement()
        token = session.execute(stmt, params).scalar()
        fenced = _InSession(session)
    elif isinstance(session, Connection):
        token = session.execute(
            dialect_for(session.dialect.name).fence_statement(), params
        ).scalar()
        fenced = _InConnection(session)
    elif isinstance(getattr(session, "vendor", None), str) and hasattr(session, "cursor"):
        token, wrapper = _fence_django(session, params)
        fenced = _InDjango(wrapper)
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
    for owner, earlier in list(FENCED.items()):
        if earlier.ended():
            FENCED.pop(owner, None)
    FENCED[lease.owner] = fenced
    return int(token)


class Fenced:
    """The transaction a lease was last fenced in (held weakly) and the thread that
    fenced it: :meth:`TaskGuard.give_back` asks it whether a release must wait."""

    __slots__ = ("thread",)

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def defer(self, lease: Any, release: Callable[[], bool]) -> bool:
        """``True`` if ``release`` was put off to the end of the fenced transaction,
        which is still open on this thread; ``False``: release now (it has ended, or
        this is another thread, which may wait for it)."""
        if not self.waits(lease):
            return False
        self._at_end(lambda: _release_after(lease, release))
        return True

    def waits(self, lease: Any) -> bool:
        """Whether a release of ``lease`` called now waits for the fenced transaction's
        end: it is still open, on this thread (:meth:`defer` puts such a release off)."""
        if self.thread != threading.get_ident():
            return False
        if not self._open():
            FENCED.pop(lease.owner, None)
            return False
        return True

    def ended(self) -> bool:
        """Whether the fenced transaction has ended (then nothing waits for it)."""
        return not self._open()

    def _open(self) -> bool:
        raise NotImplementedError

    def _at_end(self, run: Callable[[], None]) -> None:
        raise NotImplementedError


def _release_after(lease: Any, release: Callable[[], bool]) -> None:
    """The deferred release: never raises into the caller's commit or rollback (a
    lease it could not end ends by expiry, as after any failed release)."""
    FENCED.pop(lease.owner, None)
    try:
        if not release():
            log.warning(
                "lease on %r (owner %s) had already expired or been taken over when the "
                "transaction that fenced it ended",
                lease.key,
                lease.owner,
            )
    except Exception as exc:
        log.error(
            "could not release lock %r (owner %s) after the transaction that fenced it "
            "ended: %s; it ends by expiry at %s",
            lease.key,
            lease.owner,
            exc,
            lease.expires_at.isoformat(),
        )


#: Session.info keys: releases waiting for the end of the session's transaction.
_PENDING, _LISTENING = "taskguard.releases_after_transaction", "taskguard.listening"


class _InSession(Fenced):
    __slots__ = ("root", "session")

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = weakref.ref(session)
        self.root = _weak(session.get_transaction())  # begun by the fence statement

    def _open(self) -> bool:
        session, root = self.session(), self.root()
        return root is not None and session is not None and session.get_transaction() is root

    def _at_end(self, run: Callable[[], None]) -> None:
        session = self.session()
        assert session is not None  # _open() said so
        session.info.setdefault(_PENDING, []).append(run)
        if not session.info.get(_LISTENING):
            event.listen(session, "after_transaction_end", _session_ended)
            session.info[_LISTENING] = True


def _session_ended(session: Session, transaction: SessionTransaction) -> None:
    # The outermost transaction's end comes after its COMMIT or ROLLBACK was sent.
    if transaction.parent is None:
        for run in session.info.pop(_PENDING, ()):
            run()


def _weak(obj: Any) -> Callable[[], Any]:
    return (lambda: None) if obj is None else weakref.ref(obj)


class _InConnection(Fenced):
    __slots__ = ("connection", "root")

    def __init__(self, connection: Connection) -> None:
        super().__init__()
        self.connection = weakref.ref(connection)
        self.root = _weak(connection.get_transaction())  # begun by the fence statement

    def _open(self) -> bool:
        connection, root = self.connection(), self.root()
        return root is not None and connection is not None and connection.get_transaction() is root

    def _at_end(self, run: Callable[[], None]) -> None:
        raise ConfigurationError(
            "release() inside the transaction that fenced this lease would wait for the "
            "fence's own row lock: commit the transaction that fenced this lease before "
            "releasing it (a Session or Django's connection defers the release instead)"
        )


class _InDjango(Fenced):
    __slots__ = ("connection",)

    def __init__(self, connection: Any) -> None:
        super().__init__()
        self.connection = weakref.ref(connection)  # the thread's DatabaseWrapper

    def _open(self) -> bool:
        connection = self.connection()
        return connection is not None and bool(connection.in_atomic_block)

    def _at_end(self, run: Callable[[], None]) -> None:
        connection = self.connection()
        assert connection is not None  # _open() said so
        _after_django_transaction(connection, run)


def _after_django_transaction(connection: Any, run: Callable[[], None]) -> None:
    """``run`` after the connection's transaction commits (``on_commit``) or rolls
    back: Django then drops its on_commit hooks, and the dropped hook runs ``run``
    when it is freed. A savepoint rolled back under a transaction still open drops
    it too: it is then registered again, for the end of that transaction."""
    done = False

    def committed() -> None:
        nonlocal done
        done = True
        run()

    def dropped() -> None:
        if done:
            return
        if connection.in_atomic_block and not connection.closed_in_transaction:
            _after_django_transaction(connection, run)
        else:
            run()

    weakref.finalize(committed, dropped).atexit = False
    connection.on_commit(committed)


@cache
def _django_sql(vendor: str, paramstyle: str) -> tuple[str, tuple[str, ...] | None]:
    name = _DJANGO_VENDORS.get(vendor)
    if name is None:
        raise ConfigurationError(f"fence() does not support Django's {vendor!r} backend")
    # Only the SQL text is needed: compile for the backend's default dialect class.
    sa_dialect = registry.load(name)(paramstyle=paramstyle)
    compiled = compile_for(dialect_for(name).fence_statement(), sa_dialect)
    return compiled.sql, compiled.positional_names


def _fence_django(connection: Any, params: dict[str, Any]) -> tuple[Any, Any]:
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
    # cursor.db: the thread's own connection object (``connection`` may be the proxy).
    return None if row is None else row[0], cursor.db
