"""task_locks table, fencing-token source and task_locks_held view

Revision ID: tg0001
Revises:
Create Date: 2026-11-22

Self-contained on purpose (no taskguard imports): it must keep producing the
same schema when it runs inside an application's own Alembic history.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "tg0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("taskguard",)
depends_on: str | Sequence[str] | None = None

_PG_VIEW = """
CREATE VIEW task_locks_held AS
SELECT key, slot, owner, token, task_name, task_id, hostname, pid,
       acquired_at, expires_at,
       date_trunc('milliseconds', statement_timestamp() - acquired_at) AS held_for,
       date_trunc('milliseconds', expires_at - statement_timestamp()) AS expires_in
FROM task_locks
WHERE expires_at > statement_timestamp()
"""

_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f000', 'now')"
_SQLITE_VIEW = f"""
CREATE VIEW task_locks_held AS
SELECT key, slot, owner, token, task_name, task_id, hostname, pid,
       acquired_at, expires_at,
       round((julianday('now') - julianday(acquired_at)) * 86400.0, 3) AS held_for,
       round((julianday(expires_at) - julianday('now')) * 86400.0, 3) AS expires_in
FROM task_locks
WHERE expires_at > {_SQLITE_NOW}
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(sa.schema.CreateSequence(sa.Sequence("task_locks_token_seq")))
    op.create_table(
        "task_locks",
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("slot", sa.SmallInteger(), nullable=False),
        sa.Column("owner", sa.String(32), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=True),
        sa.Column("task_id", sa.String(255), nullable=True),
        sa.Column("hostname", sa.String(255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("key", "slot", name="pk_task_locks"),
    )
    if dialect == "postgresql":
        # Leave room on each page so renewals and releases stay HOT updates.
        op.execute("ALTER TABLE task_locks SET (fillfactor = 80)")
        op.execute(_PG_VIEW)
    elif dialect == "sqlite":
        op.create_table(
            "task_locks_token_counter",
            sa.Column("id", sa.Integer(), primary_key=True),
            sa.Column("value", sa.BigInteger(), nullable=False),
            sa.CheckConstraint("id = 1", name="ck_task_locks_token_counter_single_row"),
        )
        op.execute("INSERT INTO task_locks_token_counter (id, value) VALUES (1, 0)")
        # The high-water mark only ever rises, whatever happens to task_locks rows.
        for event in ("INSERT", "UPDATE OF token"):
            name = "task_locks_token_" + event.split()[0].lower()
            op.execute(
                f"CREATE TRIGGER {name} AFTER {event} ON task_locks "
                "BEGIN UPDATE task_locks_token_counter SET value = NEW.token "
                "WHERE id = 1 AND value < NEW.token; END"
            )
        op.execute(_SQLITE_VIEW)
    else:
        raise NotImplementedError(
            f"taskguard migrations support postgresql and sqlite, not {dialect}"
        )


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW IF EXISTS task_locks_held")
    if dialect == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS task_locks_token_insert")
        op.execute("DROP TRIGGER IF EXISTS task_locks_token_update")
        op.drop_table("task_locks_token_counter")
    op.drop_table("task_locks")
    if dialect == "postgresql":
        op.execute(sa.schema.DropSequence(sa.Sequence("task_locks_token_seq")))
