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


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect not in ("postgresql", "sqlite", "mysql", "mariadb"):
        raise NotImplementedError(
            f"taskguard migrations support postgresql, sqlite and mariadb, not {dialect}"
        )
    for name, type_ in _COLUMNS:
        op.add_column("task_locks", sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    for name, _type in reversed(_COLUMNS):
        # Plain ALTER TABLE … DROP COLUMN (SQLite >= 3.35), as tg0002's: a batch copy of
        # the table would silently lose tg0001's token triggers.
        op.execute(f"ALTER TABLE task_locks DROP COLUMN {name}")
