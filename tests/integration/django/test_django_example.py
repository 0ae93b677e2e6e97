"""examples/djangofeeds with a real ``celery -A feedsite worker`` (prefork, Redis
broker) on PostgreSQL, MariaDB (Django's mysql ENGINE) and SQLite, and its README's embedded default (in-process
worker, SQLite broker). The publisher runs ``manage.py import_feeds`` in a
subprocess, so Django's settings stay out of this process."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    REDIS_URL,
    drop_maria_database,
    drop_pg_database,
    new_maria_database,
    new_pg_database,
)
from djangoproject import REPO, run
from integration.celery.workers import start_worker, unique_queue
from sqlalchemy.engine import make_url

EXAMPLE = REPO / "examples" / "djangofeeds"

pytestmark = [pytest.mark.slow, pytest.mark.celery]


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def example_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {"DJANGOFEEDS_DIR": str(tmp_path)}
    if request.param == "postgresql":
        request.getfixturevalue("pg_template")
        url = new_pg_database(None)
        env["DJANGOFEEDS_DATABASE"] = (
            make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        )
        yield env
        drop_pg_database(url)
    elif request.param == "mariadb":
        request.getfixturevalue("maria_template")
        url = new_maria_database(None)
        # As the README writes it: mysql://user@host/db (Django's mysql ENGINE).
        env["DJANGOFEEDS_DATABASE"] = (
            make_url(url).set(drivername="mysql", query={}).render_as_string(hide_password=False)
        )
        yield env
        drop_maria_database(url)
    else:
        yield env


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("TASKGUARD_DATABASE_URL", "DJANGO_SETTINGS_MODULE", "DJANGOFEEDS_DATABASE"):
        env.pop(name, None)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE), str(REPO), env.get("PYTHONPATH", "")])
    return env


def _manage(env: dict[str, str], *args: str) -> str:
    cmd = [sys.executable, str(EXAMPLE / "manage.py"), *args]
    return run(cmd, _child_env(env), timeout=300).stdout


def test_feed_importer_with_a_real_worker(example_env: dict[str, str]) -> None:
    env = {
        **example_env,
        "DJANGOFEEDS_BROKER": REDIS_URL,
        "DJANGOFEEDS_RESULT_BACKEND": REDIS_URL,
    }
    _manage(env, "migrate", "--noinput")
    queue = unique_queue("djangofeeds")
    worker_env = {**_child_env(env), "DJANGO_SETTINGS_MODULE": "feedsite.settings"}
    with start_worker(
        "feedsite",
        REDIS_URL,
        "unused: the project's settings decide",
        concurrency=4,
        queue=queue,
        result_backend=REDIS_URL,
        pythonpath=(EXAMPLE, REPO),
        env=worker_env,
    ) as worker:
        out = _manage(
            env,
            "import_feeds",
            "--no-worker",
            "--queue",
            queue,
            "--feeds",
            "3",
            "--submissions",
            "24",
        )
        log = worker.log_text()
    assert "OK: every feed was imported by one worker at a time" in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith("https://")]
    assert len(rows) == 3
    for _url, submitted, ran, skipped, at_once in rows:
        assert int(submitted) == 8 and int(ran) + int(skipped) == 8 and at_once == "1"
    assert "is held by owner" in log  # the conflicts were logged with the holder
    # The locks were in the project's own database, and manage.py taskguard sees them.
    history = _manage(env, "taskguard", "explain", "feed:https://example.com/feeds/0.rss")
    assert "acquired" in history and "released" in history


def test_readme_embedded_default(tmp_path: Path) -> None:
    out = _manage({"DJANGOFEEDS_DIR": str(tmp_path)}, "import_feeds", "--submissions", "20")
    assert "OK: every feed was imported by one worker at a time" in out, out
    assert (tmp_path / "djangofeeds.sqlite3").is_file()
    assert (tmp_path / "broker.sqlite").is_file()
