"""The ``task_locks`` table, defined once with SQLAlchemy's typed ORM.

The migrations in ``migrations/`` create exactly this (a test checks they never
drift). Only ``(key, slot)`` is indexed: renewals and releases update
``expires_at`` alone, so on PostgreSQL they stay HOT updates and never touch an
index.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    Sequence,
    SmallInteger,
    String,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator, TypeEngine

__all__ = [
    "HELD_VIEW",
    "LOCKS_TABLE",
    "RELEASE_CHANNEL",
    "SQLITE_TOKEN_TABLE",
    "TOKEN_SEQUENCE",
    "VERSION_TABLE",
    "TaskLock",
    "TaskLockEvent",
    "metadata",
]

LOCKS_TABLE = "task_locks"
#: Opt-in lock history (``TaskGuard(history=True)``), trimmed by the reaper.
EVENTS_TABLE = "task_lock_events"
#: PostgreSQL channel a release NOTIFYs on when a waiter has announced itself.
RELEASE_CHANNEL = "taskguard_release"
HELD_VIEW = "task_locks_held"
#: PostgreSQL: fencing tokens come from this sequence (never goes back).
TOKEN_SEQUENCE = "task_locks_token_seq"
#: SQLite has no sequences: a one-row high-water mark kept by a trigger.
SQLITE_TOKEN_TABLE = "task_locks_token_counter"
#: MariaDB table options: InnoDB, and a byte-exact collation for keys and owners
#: (``utf8mb4_bin`` pads: it would make ``'a'`` and ``'a '`` one key).
MARIADB_TABLE_OPTIONS = {
    f"{prefix}_{option}": value
    for prefix in ("mysql", "mariadb")  # the dialect's name, per URL scheme
    for option, value in (
        ("engine", "InnoDB"),
        ("charset", "utf8mb4"),
        ("collate", "utf8mb4_nopad_bin"),
    )
}
#: taskguard's own Alembic version table; the application's ``alembic_version`` is never touched.
VERSION_TABLE = "taskguard_alembic_version"

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend.

    PostgreSQL stores ``timestamptz``; SQLite stores ISO text and MariaDB
    ``DATETIME(6)``, both naive UTC, tagged UTC here when read (taskguard only
    ever writes UTC there). Which backends store naive UTC, and in which column
    type, is each dialect's to say (:mod:`taskguard.dialects` fills in
    :attr:`naive_utc`).
    """

    impl = DateTime(timezone=True)
    cache_ok = True
    #: SQLAlchemy backend name -> its column type (``None``: the default) for the
    #: backends that store naive UTC.
    naive_utc: ClassVar[dict[str, TypeEngine[Any] | None]] = {}

    def load_dialect_impl(self, dialect: Dialect) -> Any:
        return dialect.type_descriptor(self.naive_utc.get(dialect.name) or self.impl)

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("taskguard stores timezone-aware datetimes only")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name in self.naive_utc else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        assert isinstance(value, datetime)
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    """Declarative base bound to taskguard's own :data:`metadata`."""

    metadata = metadata


token_sequence = Sequence(TOKEN_SEQUENCE, metadata=metadata)


class TaskLock(Base):
    """One lease on one slot of a key. A row outlives its lease: release only
    moves ``expires_at`` to now, and the reaper deletes long-expired rows."""

    __tablename__ = LOCKS_TABLE
    __table_args__ = MARIADB_TABLE_OPTIONS

    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    #: 0 for a mutex; 0..N-1 for a concurrency limit of N.
    slot: Mapped[int] = mapped_column(SmallInteger, primary_key=True, default=0)
    #: Random per acquisition: a redelivered task or a stale worker never matches it.
    owner: Mapped[str] = mapped_column(String(32))
    #: Fencing token: strictly increasing across all grants of all keys.
    token: Mapped[int] = mapped_column(BigInteger)
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    task_name: Mapped[str | None] = mapped_column(String(255))
    task_id: Mapped[str | None] = mapped_column(String(255))
    hostname: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    #: The lock phase the lease is in (``queue``: taken at enqueue, the job waits to
    #: run; ``run``: held by a running job); NULL for a plain acquire and older rows.
    phase: Mapped[str | None] = mapped_column(String(8))
    #: The key's concurrency limit N as the grant asked for it (1 for a mutex); NULL
    #: in rows written before it was recorded.
    slots: Mapped[int | None] = mapped_column(SmallInteger)
    # Waiting (``acquire(..., wait=...)``); NULL unless someone waited for this row.
    #: Latest deadline of any waiter: a release before it NOTIFYs (PostgreSQL trigger).
    wanted_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    #: The longest-waiting waiter: for a short grace after the lease ends only it
    #: may take the row, so a stream of newcomers cannot starve it.
    next_owner: Mapped[str | None] = mapped_column(String(32))
    next_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
    next_until: Mapped[datetime | None] = mapped_column(UTCDateTime)

    def __repr__(self) -> str:
        return f"TaskLock(key={self.key!r}, slot={self.slot}, owner={self.owner!r}, token={self.token})"


#: BIGINT on PostgreSQL; SQLite auto-increments only an ``INTEGER PRIMARY KEY``.
_EventId = BigInteger().with_variant(Integer(), "sqlite")


class TaskLockEvent(Base):
    """One line of a key's story (``TaskGuard(history=True)``): acquired, conflict,
    released, lost, taken_over, force_released, reaped. ``duration`` is in seconds:
    how long the lease was held for ending events, how long the caller waited for
    ``acquired``/``conflict``."""

    __tablename__ = EVENTS_TABLE
    __table_args__ = (
        Index("ix_task_lock_events_key_at", "key", "at"),
        Index("ix_task_lock_events_at", "at"),
        MARIADB_TABLE_OPTIONS,
    )

    id: Mapped[int] = mapped_column(_EventId, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    key: Mapped[str] = mapped_column(String(255))
    slot: Mapped[int] = mapped_column(SmallInteger)
    event: Mapped[str] = mapped_column(String(16))
    owner: Mapped[str | None] = mapped_column(String(32))
    token: Mapped[int | None] = mapped_column(BigInteger)
    duration: Mapped[float | None] = mapped_column(Float)
    task_name: Mapped[str | None] = mapped_column(String(255))
    task_id: Mapped[str | None] = mapped_column(String(255))
    hostname: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    detail: Mapped[str | None] = mapped_column(String(500))

    def __repr__(self) -> str:
        return f"TaskLockEvent({self.event!r}, key={self.key!r}, owner={self.owner!r})"
