"""``taskguard check`` / ``celery -A app taskguard check`` and the check behind them
(taskguard/startup_check.py), as real subprocesses against real databases."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from taskguard.startup_check import check_database
from taskguard.urls import parse_url

pytestmark = pytest.mark.postgres

TESTS_DIR = Path(__file__).resolve().parents[1]
TASKGUARD = [sys.executable, "-c", "from taskguard.cli import main; main()"]
CELERY = [sys.executable, "-m", "celery", "-A", "ops_app", "taskguard"]


def _run(argv: list[str], url: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TASKGUARD_DATABASE_URL": url,
        "OPS_APP_DATABASE_URL": url,
        "PYTHONPATH": str(TESTS_DIR),
    }
    return subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=60, cwd=TESTS_DIR, check=False
    )


def _plain(url: str) -> str:
    """The URL as ``postgres://`` (no driver), as DATABASE_URL settings usually are."""
    return make_url(url).set(drivername="postgres").render_as_string(hide_password=False)


@pytest.mark.parametrize("command", [TASKGUARD, CELERY], ids=["taskguard", "celery"])
def test_check_on_an_unmigrated_database_names_db_upgrade(
    empty_pg_url: str, command: list[str]
) -> None:
    proc = _run([*command, "check"], empty_pg_url)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("taskguard: "), proc.stderr
    assert "taskguard db upgrade" in lines[0]


@pytest.mark.parametrize("command", [TASKGUARD, CELERY], ids=["taskguard", "celery"])
def test_check_on_a_migrated_database_exits_0(pg_url: str, command: list[str]) -> None:
    proc = _run([*command, "check"], _plain(pg_url))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ": ok (schema at " in proc.stdout


def test_check_names_missing_privileges(pg_url: str) -> None:
    role = f"tg_check_{uuid.uuid4().hex[:8]}"
    admin = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT SELECT ON taskguard_alembic_version TO {role}")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE ON task_locks TO {role}")
    try:
        result = check_database(make_url(pg_url).set(username=role))
        assert not result.ok
        assert "DELETE on table task_locks" in result.line()
        assert "USAGE on sequence task_locks_token_seq" in result.line()
        assert "Least privilege" in result.line()
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def test_check_reports_an_unreachable_database_within_its_timeout() -> None:
    result = check_database("postgres://postgres@127.0.0.1:1/nothing", timeout=2)
    assert result.unreachable and not result.ok
    assert result.line().startswith("taskguard: postgresql+psycopg://postgres@127.0.0.1:1/")


def test_plain_postgres_schemes_mean_psycopg() -> None:
    for scheme in ("postgres", "postgresql"):
        assert parse_url(f"{scheme}://u@h/db").drivername == "postgresql+psycopg"
    assert parse_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"
    assert parse_url("sqlite:///x.db").drivername == "sqlite"
