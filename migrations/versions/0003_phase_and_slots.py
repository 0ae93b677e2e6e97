"""task_locks.phase and task_locks.slots: the lock phase a lease is in and its key's limit

Revision ID: tg0003
Revises: tg0002
Create Date: 2026-12-02

Self-contained on purpose (no taskguard imports), like tg0001. Both columns are
nullable: rows written before this revision read as "not recorded", and code of the
version before it keeps working on the upgraded table (it names its columns).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "tg0003"
down_revision: str | None = "tg0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = (
    ("phase", sa.String(8)),  # "queue" or "run"; NULL: a plain acquire, or an older row
    ("slots", sa.SmallInteger()),  # the key's limit N (1: a mutex); NULL: an older row
)

# task_locks_held as tg0001 made it, then with the two columns appended (PostgreSQL's
# CREATE OR REPLACE VIEW may only append columns; it keeps the view's privileges, as
# MariaDB's keeps them by name; SQLite has no privileges and no OR REPLACE).
_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f000', 'now')"
_VIEWS = {
    "postgresql": """
SELECT key, slot, owner, token, task_name, task_id, hostname, pid,
       acquired_at, expires_at,
       date_trunc('milliseconds', statement_timestamp() - acquired_at) AS held_for,
       date_trunc('milliseconds', expires_at - statement_timestamp()) AS expires_in{more}
FROM task_locks
WHERE expires_at > statement_timestamp()
""",
    "sqlite": f"""
SELECT key, slot, owner, token, task_name, task_id, hostname, pid,
       acquired_at, expires_at,
       round((julianday('now') - julianday(acquired_at)) * 86400.0, 3) AS held_for,
       round((julianday(expires_at) - julianday('now')) * 86400.0, 3) AS expires_in{{more}}
FROM task_locks
WHERE expires_at > {_SQLITE_NOW}
""",
    "mysql": """
SELECT `key`, slot, owner, token, task_name, task_id, hostname, pid,
       acquired_at, expires_at,
       ROUND(TIMESTAMPDIFF(MICROSECOND, acquired_at, UTC_TIMESTAMP(6)) / 1000000, 3) AS held_for,
       ROUND(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) / 1000000, 3) AS expires_in{more}
FROM task_locks
WHERE expires_at > UTC_TIMESTAMP(6)
""",
}


def _view(dialect: str, more: str, replace: bool) -> None:
    body = _VIEWS["mysql" if dialect == "mariadb" else dialect].format(more=more)
    if not replace:
        op.execute("DROP VIEW IF EXISTS task_locks_held")
    op.execute(f"CREATE {'OR REPLACE ' if replace else ''}VIEW task_locks_held AS{body}")


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect not in ("postgresql", "sqlite", "mysql", "mariadb"):
        raise NotImplementedError(
            f"taskguard migrations support postgresql, sqlite and mariadb, not {dialect}"
        )
    for name, type_ in _COLUMNS:
        op.add_column("task_locks", sa.Column(name, type_, nullable=True))
    _view(dialect, ",\n       phase, slots", dialect != "sqlite")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    _view(dialect, "", dialect not in ("postgresql", "sqlite"))  # a column less: recreated
    for name, _type in reversed(_COLUMNS):
        # Plain ALTER TABLE … DROP COLUMN (SQLite >= 3.35), as tg0002's: a batch copy of
        # the table would silently lose tg0001's token triggers.
        op.execute(f"ALTER TABLE task_locks DROP COLUMN {name}")
