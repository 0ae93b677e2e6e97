"""Least privilege (issue #7, item 9): a role with only DML on taskguard's objects
and USAGE on its sequences can do everything but migrations.

The GRANT statements below are the ones docs/reliability.md and
docs/operations.md publish; this test is what keeps them true.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from taskguard import DatabaseUnavailable, PermissionDenied, TaskGuard, schema

# Keep in sync with docs/reliability.md ("Least privilege").
GRANTS = """
GRANT CONNECT ON DATABASE {db} TO {role};
GRANT USAGE ON SCHEMA public TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON task_locks, task_lock_events TO {role};
GRANT SELECT ON task_locks_held, taskguard_alembic_version TO {role};
GRANT USAGE ON SEQUENCE task_locks_token_seq, task_lock_events_id_seq TO {role};
"""


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def app_role(pg_url: str) -> Iterator[str]:
    """A LOGIN role with only the documented grants; yields its URL."""
    role = f"tg_app_{uuid.uuid4().hex[:8]}"
    db = make_url(pg_url).database
    with psycopg.connect(_libpq(pg_url), autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        for stmt in GRANTS.format(db=f'"{db}"', role=role).strip().splitlines():
            admin.execute(stmt)
    yield make_url(pg_url).set(username=role).render_as_string(hide_password=False)
    with psycopg.connect(_libpq(pg_url), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f'REVOKE ALL ON DATABASE "{db}" FROM {role}')
        admin.execute(f"DROP ROLE {role}")


def test_app_role_can_do_everything_but_migrations(app_role: str, pg_url: str) -> None:
    guard = TaskGuard(app_role, history=True)
    try:
        lease = guard.acquire("priv", 30, task_name="t")
        assert lease is not None
        assert guard.acquire("priv", 30) is None
        assert guard.renew(lease, 60) is True
        assert guard.is_held_by(lease)
        assert guard.get("priv") is not None and guard.get_all("priv")
        assert [i.key for i in guard.held()] == ["priv"]
        adopted = guard.adopt("priv", lease.owner, 30)
        assert adopted is not None
        assert guard.release(adopted) is True
        # Concurrency limit, throttle window and waiting.
        a = guard.acquire("sem", 30, limit=2)
        b = guard.acquire("sem", 30, limit=2)
        assert a is not None and b is not None and guard.acquire("sem", 30, limit=2) is None
        threading.Timer(0.3, lambda: guard.release(a)).start()
        waited = guard.acquire("sem", 30, limit=2, wait=10)
        assert waited is not None
        throttled = guard.acquire("throttle", 30, min_hold=5)
        assert throttled is not None and guard.release(throttled) is True
        assert guard.acquire("throttle", 30) is None  # held until acquired_at + min_hold
        # Fencing inside the role's own transaction.
        engine = create_engine(app_role)
        with engine.begin() as conn:
            assert guard.fence(b, conn) == b.token
        engine.dispose()
        # Operations.
        assert guard.force_release("sem") is True
        short = guard.acquire("old", 0.01)
        assert short is not None
        time.sleep(0.05)
        assert guard.reap(grace=0.001) >= 1
        assert list(guard.events("priv"))
        assert guard.db_now() is not None
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM task_locks_held")).scalar() is not None
        assert schema.current(app_role)
    finally:
        guard.dispose()


def test_app_role_cannot_migrate(app_role: str, pg_url: str) -> None:
    with pytest.raises(Exception, match=r"(?i)permission denied|must be owner"):
        schema.downgrade(app_role, "base")
    # Nothing was dropped.
    guard = TaskGuard(pg_url)
    try:
        assert guard.acquire("still-there", 5) is not None
    finally:
        guard.dispose()


def test_missing_grant_is_named_not_reported_as_outage(app_role: str, pg_url: str) -> None:
    role = make_url(app_role).username
    with psycopg.connect(_libpq(pg_url), autocommit=True) as admin:
        admin.execute(f"REVOKE USAGE ON SEQUENCE task_locks_token_seq FROM {role}")
    guard = TaskGuard(app_role)
    try:
        with pytest.raises(PermissionDenied) as err:
            guard.acquire("k", 5)
        assert not isinstance(err.value, DatabaseUnavailable), str(err.value)
        assert "task_locks_token_seq" in str(err.value)
    finally:
        guard.dispose()
