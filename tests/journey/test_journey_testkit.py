"""The test kit as docs/django.md's "Tests" section says to use it, in a user's own
pytest run (a subprocess, in a project of its own): ``pytest_plugins =
["taskguard.testing"]`` in the top conftest.py, two tests in a row that point the
app at their lock database with ``taskguard_locks.use_for(app)`` ("until the test
ends") and run a guarded task, on SQLite (the default) and on PostgreSQL
(``--taskguard-server``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.journey.venvs import NOT_INHERITED
from tests.services import PG_URL

pytestmark = [pytest.mark.journey]

PROJECT = {
    "conftest.py": 'pytest_plugins = ["taskguard.testing"]\n',
    "tasks.py": """
        from celery import Celery

        from taskguard import guarded_task

        app = Celery("shop")
        app.conf.task_always_eager = True


        @guarded_task(app=app, key="feed:{feed_url}", ttl=60)
        def import_feed(feed_url):
            return f"imported {feed_url}"
        """,
    "test_feeds.py": """
        from tasks import app, import_feed


        def test_first(taskguard_locks):
            taskguard_locks.use_for(app)
            assert import_feed.delay("a").get() == "imported a"
            taskguard_locks.assert_free("feed:a")
            assert taskguard_locks.guard.get("feed:a") is not None  # the run's row, in this test's database


        def test_second(taskguard_locks):
            # use_for() lasted until the first test ended
            assert app.conf.get("taskguard_database_url") is None
            taskguard_locks.use_for(app)
            assert import_feed.delay("b").get() == "imported b"
            assert taskguard_locks.guard.get("feed:b") is not None
            assert taskguard_locks.guard.get("feed:a") is None  # nothing of the first test's
        """,
}


@pytest.mark.parametrize("mode", ["sqlite", "postgresql"])
def test_two_tests_in_a_row(mode: str, tmp_path: Path) -> None:
    for name, text in PROJECT.items():
        (tmp_path / name).write_text(textwrap.dedent(text).lstrip())
    args = ["--taskguard-server", PG_URL] if mode == "postgresql" else []
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout, done.stdout
