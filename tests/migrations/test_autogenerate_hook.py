"""docs/alembic.md's one rule, shown on a real database: without the
``include_object`` hook, autogenerate would drop taskguard's tables (and why
``target_metadata=[...]`` is enough only for way 2). The page itself runs as
written in tests/docs (docs/alembic.md's blocks)."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

import taskguard
from taskguard import schema


@pytest.mark.postgres
def test_without_the_hook_autogenerate_would_drop_taskguard(empty_pg_url: str) -> None:
    """Why the page's env.py has include_object (and why target_metadata=[...] is
    enough only for way 2)."""
    import sqlalchemy as sa

    app_metadata = sa.MetaData()
    sa.Table("orders", app_metadata, sa.Column("id", sa.Integer, primary_key=True))
    engine = create_engine(empty_pg_url)
    with engine.begin() as conn:
        app_metadata.create_all(conn)
    schema.upgrade(empty_pg_url)  # way 1: also creates taskguard_alembic_version

    def diff(metadata: object, **opts: object) -> list[object]:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts=opts)
            return list(compare_metadata(ctx, metadata))

    def removed_tables(ops: list[object]) -> set[str]:
        return {op[1].name for op in ops if isinstance(op, tuple) and op[0] == "remove_table"}

    try:
        assert "task_locks" in removed_tables(diff(app_metadata))
        assert diff(app_metadata, include_object=schema.exclude_taskguard_objects) == []
        # Listing taskguard's metadata hides its tables but not way 1's version table.
        assert removed_tables(diff([app_metadata, taskguard.metadata])) == {
            "taskguard_alembic_version"
        }
    finally:
        engine.dispose()
