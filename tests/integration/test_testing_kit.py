"""taskguard.testing as a user loads it (``-p taskguard.testing``), in a separate
pytest run on a throwaway project: the lock-database fixtures on SQLite and
PostgreSQL, the held/free assertions, and the switch that turns locking off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest

from tests.services import PG_URL
from tests.services import libpq as _libpq

USER_TESTS = textwrap.dedent(
    """
    import pytest
    from celery import Celery

    from taskguard import guarded_task

    app = Celery("kit", set_as_current=False)
    app.conf.task_always_eager = True


    @guarded_task(app=app, key="feed:{url}", ttl=30)
    def import_feed(url):
        return "imported " + url


    def test_held_then_free(taskguard_guard, taskguard_locks):
        lease = taskguard_guard.acquire("feed:a", ttl=30, task_name="feeds.import_feed")
        taskguard_locks.assert_held("feed:a", task_name="feeds.import_feed", slots=1)
        with pytest.raises(AssertionError, match="expected 'feed:a' to be free; held by: owner"):
            taskguard_locks.assert_free("feed:a")
        taskguard_guard.release(lease)
        taskguard_locks.assert_free("feed:a")
        with pytest.raises(AssertionError, match="expected 'feed:a' to be held, but it is free"):
            taskguard_locks.assert_held("feed:a")


    def test_guarded_task_uses_the_test_database(taskguard_locks):
        taskguard_locks.use_for(app)
        assert import_feed.delay("a").get() == "imported a"
        taskguard_locks.assert_free("feed:a")
        assert taskguard_locks.guard.get("feed:a") is not None  # the run's row is there


    def test_off_for_one_test(taskguard_off):
        # No database is configured for this app at all: nothing is locked.
        app.conf.taskguard_database_url = None
        assert import_feed.delay("b").get() == "imported b"
    """
)

OFF_TESTS = textwrap.dedent(
    """
    from celery import Celery

    from taskguard import current_lease, guarded_task

    app = Celery("kit_off", set_as_current=False)
    app.conf.task_always_eager = True


    @guarded_task(app=app, key="feed:{url}", ttl=30)
    def import_feed(url):
        return current_lease().fence(object())


    def test_one():
        assert import_feed.delay("a").get() >= 1


    def test_two():
        assert import_feed.delay("a").get() >= 1
    """
)


TWO_IN_A_ROW = textwrap.dedent(
    """
    import os

    from celery import Celery
    from sqlalchemy.engine import make_url

    from taskguard import guarded_task

    ORIGINAL = "sqlite:////nonexistent/the-apps-own.sqlite"
    configured = Celery("configured", set_as_current=False)
    configured.conf.task_always_eager = True
    configured.conf.taskguard_database_url = ORIGINAL
    bare = Celery("bare", set_as_current=False)
    bare.conf.task_always_eager = True
    seen = []


    @guarded_task(app=configured, key="feed:{url}", ttl=30)
    def import_feed(url):
        return "imported " + url


    def test_first_points_the_apps_at_its_database(taskguard_locks, taskguard_database_url):
        taskguard_locks.use_for(configured)
        taskguard_locks.use_for(bare)
        assert configured.conf.taskguard_database_url == taskguard_database_url
        assert bare.conf.taskguard_database_url == taskguard_database_url
        assert import_feed.delay("a").get() == "imported a"
        seen.append(taskguard_database_url)


    def test_second_finds_the_apps_as_they_were(taskguard_database_url):
        assert configured.conf.taskguard_database_url == ORIGINAL
        assert bare.conf.get("taskguard_database_url") is None
        assert taskguard_database_url != seen[0]
        prefix = os.environ.get("EXPECT_PREFIX")
        if prefix:
            for url in (seen[0], taskguard_database_url):
                assert make_url(url).database.startswith(prefix), url
    """
)


def _pytest(tmp_path: Path, source: str, *args: str, env: dict[str, str] | None = None) -> str:
    (tmp_path / "test_user_project.py").write_text(source)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    child = dict(os.environ)
    child.pop("TASKGUARD_DATABASE_URL", None)
    child.pop("TASKGUARD_LOCKING", None)
    child.update(env or {})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "taskguard.testing",
            "-p",
            "no:cacheprovider",
            "-q",
            *args,
        ],
        cwd=tmp_path,
        env=child,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


def test_fixtures_on_sqlite(tmp_path: Path) -> None:
    out = _pytest(tmp_path, USER_TESTS)
    assert "3 passed" in out


def test_fixtures_on_postgresql(tmp_path: Path, pg_template: str) -> None:
    out = _pytest(tmp_path, USER_TESTS, "--taskguard-server", PG_URL)
    assert "3 passed" in out


def test_use_for_lasts_until_the_test_ends_on_sqlite(tmp_path: Path) -> None:
    """Issue 27, item 5: the next test found the app pointing at the previous test's
    (already removed) database."""
    assert "2 passed" in _pytest(tmp_path, TWO_IN_A_ROW)


def test_use_for_lasts_until_the_test_ends_on_postgresql_with_chosen_names(
    tmp_path: Path, pg_template: str
) -> None:
    prefix = f"kit{os.getpid()}_"
    out = _pytest(
        tmp_path,
        TWO_IN_A_ROW,
        "--taskguard-server",
        PG_URL,
        "--taskguard-db-prefix",
        prefix,
        env={"EXPECT_PREFIX": prefix},
    )
    assert "2 passed" in out
    with psycopg.connect(_libpq(PG_URL), autocommit=True) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", (prefix + "%",)
        ).fetchall()
    assert left == []  # the template and both tests' databases were dropped


def test_a_bad_database_prefix_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x(taskguard_database_url):\n    pass\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "taskguard.testing", "-q",
         "--taskguard-server", PG_URL, "--taskguard-db-prefix", 'bad"name'],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--taskguard-db-prefix" in proc.stdout + proc.stderr


@pytest.mark.parametrize("how", ["env", "ini"])
def test_locking_off_for_the_run_logs_once(tmp_path: Path, how: str) -> None:
    args = ["-o", "log_cli=true", "--log-cli-level=WARNING"]
    env = {"TASKGUARD_LOCKING": "off"} if how == "env" else {}
    if how == "ini":
        args += ["-o", "taskguard_locking=off"]
    out = _pytest(tmp_path, OFF_TESTS, *args, env=env)
    assert "2 passed" in out
    assert out.count("locking is OFF") == 1, out
