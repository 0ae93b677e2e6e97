"""taskguard.contrib.django_tasks with real django-tasks-db ``db_worker`` processes,
through examples/djangotasksfeeds (its ``import_feeds`` command: 200 enqueues over 5
feeds, a 0.2 s body, two workers; each run's start and end by the database clock are
the independent record). Runs on whatever Django this Python has: the django-tasks
backport on Django 5.2, django.tasks on Django 6 (.ci/run's Python 3.12 step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from djtasks_sites import example_env_fixture  # noqa: F401 (the example_env fixture)

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "djangotasksfeeds"

pytestmark = [pytest.mark.slow, pytest.mark.django_tasks]


@pytest.fixture
def site_env(example_env: dict[str, str]) -> dict[str, str]:
    return {**example_env, "DJANGO_SETTINGS_MODULE": "feedsite.settings"}


def _run(env: dict[str, str], *args: str, timeout: float = 240) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=EXAMPLE, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _import(env: dict[str, str], task: str) -> list[dict[str, int]]:
    out = _run(env, "manage.py", "import_feeds", "--json", "--task", task)
    rows: list[dict[str, int]] = json.loads(out.strip().splitlines()[-1])
    print(task, json.dumps(rows))
    assert len(rows) == 5
    for row in rows:
        assert row["enqueued"] == 40
        assert row["most_at_once"] == 1, row  # no overlap, every run ended
        assert row["failed"] == 0, row
    return rows


def test_run_lock_two_workers(site_env: dict[str, str]) -> None:
    """@guarded alone: every enqueue is queued; a run that finds its feed held is
    skipped (returns the skipped marker); the others ran."""
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


def test_sigkilled_worker_leaves_nothing_stuck(site_env: dict[str, str]) -> None:
    env = {**site_env, "DJANGOTASKSFEEDS_LOCK_TTL": "2", "DJANGOTASKSFEEDS_FETCH_SECONDS": "4"}
    _run(env, "manage.py", "migrate", "-v", "0")
    out = _run(env, str(Path(__file__).with_name("scenario_kill.py")), timeout=180)
    seen = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    print(seen)
    assert seen["answered_while_held"] is True
    assert 0.5 < seen["accepted_after_s"] < 30  # the lease (ttl 2 s) ran out, not sooner
    assert seen["second_status"] == "SUCCESSFUL" and seen["runs"] == 2
    assert seen["second_return"] == 1  # the killed run never stored its import


def test_simultaneous_duplicates_are_answered_with_the_queued_job(
    site_env: dict[str, str],
) -> None:
    """Issue 41, defect 2: 50 enqueues at once (3 processes x 5 threads) of a
    lock="queue_and_run", on_conflict="existing" task: one job, every duplicate
    answered with it (none raises AlreadyLocked from the gap before the job existed)."""
    _run(site_env, "manage.py", "migrate", "-v", "0")
    out = _run(site_env, str(Path(__file__).with_name("scenario_duplicates.py")), timeout=180)
    answers = json.loads(out.strip().splitlines()[-1])
    assert len(answers) == 50
    errors = [a for a in answers if not a.startswith("job ")]
    assert errors == [], f"{len(errors)} raised, e.g. {errors[:2]}"
    assert len(set(answers)) == 1, sorted(set(answers))
