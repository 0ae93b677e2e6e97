"""Running the ``taskguard`` command line and ``celery -A … taskguard`` as real
subprocesses against real databases, for the test_cli* modules. Every invocation
goes through ``run()``, which also checks that the database password never
appears in any output. Import the fixtures into a test module
(``from cli_runner import env, guard, ...``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import MySQLdb
import pytest
from sqlalchemy.engine import make_url

from taskguard import TaskGuard

TESTS_DIR = Path(__file__).resolve().parents[1]
PASSWORD = "s3cr3t-Pa55"  # PostgreSQL trust auth ignores it; it must never be printed

_script = shutil.which("taskguard", path=str(Path(sys.executable).parent)) or shutil.which(
    "taskguard"
)
TASKGUARD = (
    [_script] if _script else [sys.executable, "-c", "from taskguard.cli import main; main()"]
)
CELERY = [sys.executable, "-m", "celery", "-A", "ops_app", "taskguard"]


def with_password(url: str) -> str:
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def run(
    argv: list[str], env: dict[str, str], input: str | None = None, code: int = 0
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv,
        env=env,
        input=input if input is not None else "",
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TESTS_DIR,
        check=False,
    )
    both = proc.stdout + proc.stderr
    assert PASSWORD not in both, both
    assert proc.returncode == code, f"exit {proc.returncode}, wanted {code}\n{both}"
    if code != 0:
        # The error is one line, prefixed, on stderr (after a confirmation prompt, if any).
        lines = proc.stderr.splitlines()
        assert proc.stderr.endswith("\n"), proc.stderr
        assert lines[-1].startswith("taskguard: "), proc.stderr
        # (click < 8.2 writes the prompt's last space to stdout, hence the rstrip)
        assert len(lines) == 1 or (len(lines) == 2 and lines[0].rstrip().endswith("[y/N]:")), (
            proc.stderr
        )
    return proc


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKGUARD_", "OPS_APP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(params=["postgresql", "mariadb"])
def lock_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test's database, as a role that has a password (it must never be printed)."""
    if request.param == "postgresql":
        yield str(request.getfixturevalue("pg_url"))
        return
    plain = make_url(str(request.getfixturevalue("maria_url")))
    user = f"tg_cli_{plain.database}"[:32]
    admin = MySQLdb.connect(host=plain.host, port=plain.port, user="root", autocommit=True)
    cur = admin.cursor()
    cur.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{PASSWORD}'")
    cur.execute(f"GRANT ALL ON `{plain.database}`.* TO '{user}'@'%'")
    yield plain.set(username=user).render_as_string(hide_password=False)
    cur.execute(f"DROP USER '{user}'@'%'")
    admin.close()


@pytest.fixture
def url(lock_url: str) -> str:
    return with_password(lock_url)


@pytest.fixture
def env(url: str) -> dict[str, str]:
    return {**base_env(), "TASKGUARD_DATABASE_URL": url}


@pytest.fixture
def guard(url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(url)
    yield g
    g.dispose()


def tg(*args: str, env: dict[str, str], input: str | None = None, code: int = 0) -> str:
    return run([*TASKGUARD, *args], env, input, code).stdout
