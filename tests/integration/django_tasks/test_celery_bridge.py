"""taskguard.contrib.django_tasks on Celery: examples/djangotasksfeeds' feed tasks
enqueued by django-tasks-celery's CeleryBackend (GuardedBackend in front, celerysite)
onto Redis (DB 2, a queue per test) and run by a real prefork ``celery worker -c 2``
(scenario_celery.py: 200 enqueues over 5 feeds, a 0.2 s body; each run's start and
end by the database clock are the independent record), on PostgreSQL, MariaDB and
SQLite (the example site's own database holds the locks). django-tasks-celery needs
Django 6 (Python 3.12): .ci/run's Django 6 step installs it and runs these."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest
import redis
from djtasks_sites import example_env_fixture  # noqa: F401 (the example_env fixture)

from tests.services import redis_url

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
EXAMPLE = REPO / "examples" / "djangotasksfeeds"

pytestmark = [
    pytest.mark.celery,
    pytest.mark.django_tasks,
    pytest.mark.skipif(
        find_spec("django.tasks") is None,
        reason="django-tasks-celery needs Django 6 (.ci/run's Python 3.12 step runs these)",
    ),
]


@pytest.fixture
def site_env(example_env: dict[str, str]) -> Iterator[dict[str, str]]:
    env = {
        **example_env,
        "DJANGO_SETTINGS_MODULE": "celerysite.settings",
        "CELERYSITE_BROKER": redis_url(2),
        "CELERYSITE_QUEUE": f"taskguard-djcelery-{uuid.uuid4().hex[:8]}",
    }
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
    yield env
    broker = redis.Redis.from_url(env["CELERYSITE_BROKER"])  # the queue's keys (results expire)
    for name in broker.scan_iter(match=f"*{env['CELERYSITE_QUEUE']}*"):
        broker.delete(name)
    broker.close()


def _scenario(env: dict[str, str], what: str) -> object:
    proc = subprocess.run(
        [sys.executable, str(HERE / "scenario_celery.py"), what], cwd=EXAMPLE, env=env,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    seen = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    print(what, json.dumps(seen))
    return seen["rows"]


def _import(env: dict[str, str], task: str) -> list[dict[str, int]]:
    rows = _scenario(env, task)
    assert isinstance(rows, list) and len(rows) == 5
    for row in rows:
        assert row["enqueued"] == 40
        assert row["most_at_once"] == 1, row  # no overlap, every run ended
        assert row["failed"] == 0, row
    return rows


def test_run_lock_prefork_worker(site_env: dict[str, str]) -> None:
    """@guarded alone: every enqueue is a Celery message; a run that finds its feed
    held is skipped (returns the skipped marker); the others ran."""
    for row in _import(site_env, "import_feed"):
        assert row["jobs"] == 40 and row["refused"] == 0
        assert row["ran"] + row["skipped"] == 40 and row["ran"] >= 1


def test_queue_lock_answers_with_existing_job(site_env: dict[str, str]) -> None:
    for row in _import(site_env, "import_feed_once"):
        assert row["refused"] == 0
        assert row["jobs"] + row["answered_existing"] == 40
        assert row["ran"] == row["jobs"] >= 1 and row["skipped"] == 0


def test_queue_lock_refuses_duplicates(site_env: dict[str, str]) -> None:
    for row in _import(site_env, "import_feed_strict"):
        assert row["jobs"] + row["refused"] == 40 and row["refused"] >= 1
        assert row["ran"] == row["jobs"] and row["skipped"] == 0


def test_sigkilled_pool_process_leaves_nothing_stuck(site_env: dict[str, str]) -> None:
    """The pool process running a job is SIGKILLed: Celery fails that job; its lease
    (ttl 2 s, no longer renewed) expires and the next enqueue is accepted and runs."""
    env = {**site_env, "DJANGOTASKSFEEDS_LOCK_TTL": "2", "DJANGOTASKSFEEDS_FETCH_SECONDS": "4"}
    seen = _scenario(env, "kill")
    assert isinstance(seen, dict)
    assert seen["first_status"] == "FAILED"  # WorkerLostError
    assert seen["answered_while_held"] is True and seen["answer_has_task"] is True
    assert 0.5 < seen["accepted_after_s"] < 30  # the lease (ttl 2 s) ran out, not sooner
    assert seen["second_status"] == "SUCCESSFUL" and seen["runs"] == 2
    assert seen["second_return"] == 1  # the killed run never stored its import
