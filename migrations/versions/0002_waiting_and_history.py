"""waiting (waiter columns, release NOTIFY trigger) and the task_lock_events history table

Revision ID: tg0002
Revises: tg0001
Create Date: 2026-11-22

Self-contained on purpose (no taskguard imports), like tg0001.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "tg0002"
down_revision: str | None = "tg0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# MariaDB: DATETIME(6) (plain DATETIME drops the fractional seconds).
_TS = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
_WAITER_COLUMNS = (
    ("wanted_until", _TS),
    ("next_owner", sa.String(32)),
    ("next_since", _TS),
    ("next_until", _TS),
)
_MARIADB = ("mysql", "mariadb")
#: As tg0001's: byte-exact keys.
_MARIADB_TABLE = {
    f"{prefix}_{option}": value
    for prefix in ("mysql", "mariadb")  # the dialect's name, per URL scheme
    for option, value in (
        ("engine", "InnoDB"),
        ("charset", "utf8mb4"),
        ("collate", "utf8mb4_nopad_bin"),
    )
}

# A release (expires_at moved earlier) NOTIFYs only while a waiter has announced
# itself (wanted_until later than the new expiry). Without waiters the WHEN clause
# is false, no notification is queued, and the commit never takes NOTIFY's global lock.
_PG_NOTIFY_FUNCTION = """
CREATE FUNCTION taskguard_notify_release() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('taskguard_release', NEW.key);
    RETURN NULL;
END
$$
"""
_PG_NOTIFY_TRIGGER = """
CREATE TRIGGER task_locks_notify_release
AFTER UPDATE OF expires_at ON task_locks
FOR EACH ROW
WHEN (NEW.wanted_until > NEW.expires_at AND NEW.expires_at < OLD.expires_at)
EXECUTE FUNCTION taskguard_notify_release()
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect not in ("postgresql", "sqlite", *_MARIADB):
        raise NotImplementedError(
            f"taskguard migrations support postgresql, sqlite and mariadb, not {dialect}"
        )
    for name, type_ in _WAITER_COLUMNS:
        op.add_column("task_locks", sa.Column(name, type_, nullable=True))
    if dialect == "postgresql":
        op.execute(_PG_NOTIFY_FUNCTION)
        op.execute(_PG_NOTIFY_TRIGGER)
    op.create_table(
        "task_lock_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
        ),
        sa.Column("at", _TS, nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("slot", sa.SmallInteger(), nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(32), nullable=True),
        sa.Column("token", sa.BigInteger(), nullable=True),
        sa.Column("duration", sa.Float(), nullable=True),
        sa.Column("task_name", sa.String(255), nullable=True),
        sa.Column("task_id", sa.String(255), nullable=True),
        sa.Column("hostname", sa.String(255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("detail", sa.String(500), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_task_lock_events"),
        **(_MARIADB_TABLE if dialect in _MARIADB else {}),
    )
    op.create_index("ix_task_lock_events_key_at", "task_lock_events", ["key", "at"])
    op.create_index("ix_task_lock_events_at", "task_lock_events", ["at"])


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.drop_index("ix_task_lock_events_at", table_name="task_lock_events")
    op.drop_index("ix_task_lock_events_key_at", table_name="task_lock_events")
    op.drop_table("task_lock_events")
    if dialect == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS task_locks_notify_release ON task_locks")
        op.execute("DROP FUNCTION IF EXISTS taskguard_notify_release()")
    for name, _type in reversed(_WAITER_COLUMNS):
        # Plain ALTER TABLE … DROP COLUMN (SQLite >= 3.35): a batch copy of the table
        # would silently lose tg0001's token triggers.
        op.execute(f"ALTER TABLE task_locks DROP COLUMN {name}")
