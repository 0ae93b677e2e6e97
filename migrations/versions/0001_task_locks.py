"""task_locks table, fencing-token source and task_locks_held view

Revision ID: tg0001
Revises:
Create Date: 2026-11-22

Self-contained on purpose (no taskguard imports): it must keep producing the
same schema when it runs inside an application's own Alembic history.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

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


# MariaDB: UTC_TIMESTAMP(6) is the clock; DATETIME(6) columns hold UTC.
_MARIADB_VIEW = """
CREATE VIEW task_locks_held AS
SELECT `key`, slot, owner, token, task_name, task_id, hostname, pid,
       acquired_at, expires_at,
       ROUND(TIMESTAMPDIFF(MICROSECOND, acquired_at, UTC_TIMESTAMP(6)) / 1000000, 3) AS held_for,
       ROUND(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) / 1000000, 3) AS expires_in
FROM task_locks
WHERE expires_at > UTC_TIMESTAMP(6)
"""
#: MariaDB table options: byte-exact keys ('a', 'A' and 'a ' are three keys).
MARIADB_TABLE = {
    f"{prefix}_{option}": value
    for prefix in ("mysql", "mariadb")  # the dialect's name, per URL scheme
    for option, value in (
        ("engine", "InnoDB"),
        ("charset", "utf8mb4"),
        ("collate", "utf8mb4_nopad_bin"),
    )
}
_MARIADB_MIN = (10, 6)


def _ts() -> sa.types.TypeEngine[datetime]:
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def refuse_unsupported(bind: sa.engine.Connection | None, dialect: str) -> None:
    """Raise before anything is created unless taskguard supports this database.

    ``bind`` is None in offline mode (``taskguard db sql``): the server is unknown,
    only the dialect's name is checked."""
    if dialect in ("postgresql", "sqlite"):
        return
    if dialect in ("mysql", "mariadb"):
        if bind is None:
            return
        info = bind.dialect
        version = tuple(info.server_version_info or ())
        if info.is_mariadb and version >= _MARIADB_MIN:
            return
        server = "MariaDB" if info.is_mariadb else "MySQL"
        raise NotImplementedError(
            f"taskguard needs MariaDB 10.6 or newer; this server is {server} "
            f"{'.'.join(map(str, version))} (MySQL has no sequences for fencing tokens)"
        )
    raise NotImplementedError(
        f"taskguard migrations support postgresql, sqlite and mariadb, not {dialect}"
    )


def upgrade() -> None:
    bind = op.get_bind()
    dialect = bind.dialect.name
    refuse_unsupported(None if op.get_context().as_sql else bind, dialect)
    mariadb = dialect in ("mysql", "mariadb")
    if dialect == "postgresql" or mariadb:
        op.execute(sa.schema.CreateSequence(sa.Sequence("task_locks_token_seq")))
    op.create_table(
        "task_locks",
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("slot", sa.SmallInteger(), nullable=False),
        sa.Column("owner", sa.String(32), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", _ts(), nullable=False),
        sa.Column("expires_at", _ts(), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=True),
        sa.Column("task_id", sa.String(255), nullable=True),
        sa.Column("hostname", sa.String(255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("key", "slot", name="pk_task_locks"),
        **(MARIADB_TABLE if mariadb else {}),
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
        op.execute(_MARIADB_VIEW)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW IF EXISTS task_locks_held")
    if dialect == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS task_locks_token_insert")
        op.execute("DROP TRIGGER IF EXISTS task_locks_token_update")
        op.drop_table("task_locks_token_counter")
    op.drop_table("task_locks")
    if dialect in ("postgresql", "mysql", "mariadb"):
        op.execute(sa.schema.DropSequence(sa.Sequence("task_locks_token_seq")))
