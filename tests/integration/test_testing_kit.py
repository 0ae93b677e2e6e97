"""taskguard.testing as a user loads it (``-p taskguard.testing``), in a separate
pytest run on a throwaway project: the lock-database fixtures on SQLite and
PostgreSQL, the held/free assertions, and the switch that turns locking off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import PG_URL

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


@pytest.mark.parametrize("how", ["env", "ini"])
def test_locking_off_for_the_run_logs_once(tmp_path: Path, how: str) -> None:
    args = ["-o", "log_cli=true", "--log-cli-level=WARNING"]
    env = {"TASKGUARD_LOCKING": "off"} if how == "env" else {}
    if how == "ini":
        args += ["-o", "taskguard_locking=off"]
    out = _pytest(tmp_path, OFF_TESTS, *args, env=env)
    assert "2 passed" in out
    assert out.count("locking is OFF") == 1, out
