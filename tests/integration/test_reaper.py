"""The reaper task and its beat schedule, against real PostgreSQL (and SQLite),
including two reapers at once, acquires racing the reaper, and a real worker
with embedded beat running it on schedule."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.schedules import crontab
from conftest import REDIS_URL
from sqlalchemy.engine import make_url

import taskguard
from taskguard import ConfigurationError, Lease, TaskGuard
from taskguard.celery.reaper import SCHEDULE_KEY, TASK_NAME
from taskguard.config import reset_guards
from taskguard.signals import locks_reaped

pytestmark = pytest.mark.postgres

TESTS_DIR = Path(__file__).resolve().parents[1]


def libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def seed(url: str, prefix: str, count: int, expires: str, acquired: str = "-2 hours") -> None:
    """``count`` rows ``prefix000001…`` whose lease ends at now + ``expires`` (an
    interval literal), with fresh fencing tokens; one statement."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute(
            """
            INSERT INTO task_locks (key, slot, owner, token, acquired_at, expires_at,
                                    task_name, task_id, hostname, pid)
            SELECT %(prefix)s || lpad(g::text, 6, '0'), 0, md5(random()::text),
                   nextval('task_locks_token_seq'),
                   statement_timestamp() + %(acquired)s::interval,
                   statement_timestamp() + %(expires)s::interval,
                   'tests.seeded', 'task-' || g, 'seed-host', g
            FROM generate_series(1, %(count)s) AS g
            """,
            {"prefix": prefix, "count": count, "expires": expires, "acquired": acquired},
        )


def count(url: str, where: str = "true") -> int:
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM task_locks WHERE {where}").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def app(pg_url: str) -> Iterator[Celery]:
    app = Celery("reaper-tests", set_as_current=False)
    app.conf.taskguard_database_url = pg_url
    yield app
    reset_guards()


# -- the task ---------------------------------------------------------------------------


def test_reaper_task_removes_100k_expired_rows_and_keeps_live_ones(
    app: Celery, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    seed(pg_url, "expired:", 100_000, "-1 hour")
    seed(pg_url, "live:", 1_000, "1 hour", acquired="-1 minute")
    seed(pg_url, "recent:", 1_000, "-10 seconds")  # ended, but within the grace period
    received: list[dict[str, Any]] = []

    def on_reaped(sender: Any = None, **kwargs: Any) -> None:
        received.append({"sender": sender, **kwargs})

    locks_reaped.connect(on_reaped, weak=False)
    try:
        with caplog.at_level(logging.INFO, logger="taskguard.reaper"):
            started = time.monotonic()
            removed = app.tasks[TASK_NAME].apply(kwargs={"grace": 300}).get()
            elapsed = time.monotonic() - started
    finally:
        locks_reaped.disconnect(on_reaped)

    assert removed == 100_000
    assert count(pg_url, "key LIKE 'expired:%'") == 0
    assert count(pg_url, "key LIKE 'live:%'") == 1_000
    assert count(pg_url, "key LIKE 'recent:%'") == 1_000
    assert [r["count"] for r in received] == [100_000]
    assert received[0]["sender"].name == TASK_NAME
    messages = [r.getMessage() for r in caplog.records if r.name == "taskguard.reaper"]
    assert any(m.startswith("reaper removed 100000 lock row(s)") for m in messages), messages
    print(f"reaper task: 100000 rows in {elapsed:.2f}s = {100_000 / elapsed:,.0f} rows/s")


def test_reaper_task_uses_app_settings(db_url: str) -> None:
    app = Celery("reaper-settings", set_as_current=False)
    app.conf.taskguard_database_url = db_url
    app.conf.taskguard_reaper_grace = 0
    app.conf.taskguard_reaper_batch_size = 2
    guard = TaskGuard(db_url)
    try:
        for i in range(5):
            assert guard.acquire(f"gone:{i}", 0.001) is not None
        live = guard.acquire("kept", 600)
        assert live is not None
        time.sleep(0.05)
        assert app.tasks[TASK_NAME].apply().get() == 5
        assert guard.is_held_by(live)
        assert [i.key for i in guard.held(include_expired=True)] == ["kept"]
        # Nothing left: a second run removes nothing and still succeeds.
        assert app.tasks[TASK_NAME].apply().get() == 0
    finally:
        guard.dispose()
        reset_guards()


def test_two_reapers_at_once_remove_each_row_once(pg_url: str) -> None:
    seed(pg_url, "expired:", 100_000, "-1 hour")
    seed(pg_url, "live:", 1_000, "1 hour", acquired="-1 minute")
    guards = [TaskGuard(pg_url), TaskGuard(pg_url)]
    barrier = threading.Barrier(2)
    results: list[int] = [0, 0]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = int(guards[i].reap(grace=60, batch_size=1_000))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        for g in guards:
            g.dispose()
    assert not errors, errors
    print(f"two reapers removed {results[0]} + {results[1]}")
    assert sum(results) == 100_000
    assert count(pg_url, "key LIKE 'expired:%'") == 0
    assert count(pg_url, "key LIKE 'live:%'") == 1_000


def test_a_lease_taken_while_the_reaper_runs_is_never_reaped(pg_url: str) -> None:
    seed(pg_url, "k:", 20_000, "-1 hour")
    reaper_guard, acquirer = TaskGuard(pg_url), TaskGuard(pg_url)
    done = threading.Event()
    removed: list[int] = []

    def reap() -> None:
        try:
            removed.append(int(reaper_guard.reap(grace=0, batch_size=250)))
        finally:
            done.set()

    leases: list[Lease] = []
    rng = random.Random(7)
    thread = threading.Thread(target=reap)
    try:
        thread.start()
        while not done.is_set():
            lease = acquirer.acquire(f"k:{rng.randint(1, 20_000):06d}", 600)
            if lease is not None:
                leases.append(lease)
        thread.join(timeout=60)
        assert removed, "reaper did not finish"
        assert leases
        print(f"{len(leases)} leases taken while the reaper removed {removed[0]} rows")
        lost = [lease.key for lease in leases if not acquirer.is_held_by(lease)]
        assert lost == []
        # Every expired row is gone; only the leases taken during the run remain.
        assert count(pg_url, "expires_at <= statement_timestamp()") == 0
        assert count(pg_url) == len({lease.key for lease in leases})
    finally:
        reaper_guard.dispose()
        acquirer.dispose()


# -- the schedule -------------------------------------------------------------------------


def test_schedule_reaper_installs_a_beat_entry() -> None:
    app = Celery("sched", set_as_current=False)
    assert taskguard.schedule_reaper(app, every=30, grace=120, batch_size=500) == SCHEDULE_KEY
    entry = app.conf.beat_schedule[SCHEDULE_KEY]
    assert entry["task"] == TASK_NAME
    assert entry["schedule"] == 30.0
    assert entry["kwargs"] == {"grace": 120.0, "batch_size": 500}
    assert entry["options"] == {"expires": 30.0}
    assert TASK_NAME in app.tasks

    # Calling again replaces the entry; defaults leave the settings to the worker.
    taskguard.schedule_reaper(app, every=timedelta(minutes=2))
    entry = app.conf.beat_schedule[SCHEDULE_KEY]
    assert entry["schedule"] == 120.0
    assert entry["kwargs"] == {}

    taskguard.schedule_reaper(app, every=crontab(minute="*/5"), queue="maintenance")
    entry = app.conf.beat_schedule[SCHEDULE_KEY]
    assert isinstance(entry["schedule"], crontab)
    assert entry["options"] == {"queue": "maintenance"}


def test_schedule_reaper_default_interval_comes_from_the_setting() -> None:
    app = Celery("sched-default", set_as_current=False)
    taskguard.schedule_reaper(app)
    assert app.conf.beat_schedule[SCHEDULE_KEY]["schedule"] == 60.0
    app2 = Celery("sched-setting", set_as_current=False)
    app2.conf.taskguard_reaper_interval = 15
    taskguard.schedule_reaper(app2)
    assert app2.conf.beat_schedule[SCHEDULE_KEY]["schedule"] == 15.0


def test_setting_alone_schedules_the_reaper_when_the_app_is_finalized() -> None:
    app = Celery("sched-by-setting", set_as_current=False)
    app.conf.taskguard_reaper_interval = 45
    app.finalize()
    assert app.conf.beat_schedule[SCHEDULE_KEY]["schedule"] == 45.0
    plain = Celery("no-reaper", set_as_current=False)
    plain.finalize()
    assert SCHEDULE_KEY not in plain.conf.beat_schedule


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": 0}, "positive number of seconds"),
        ({"every": float("nan")}, "positive number of seconds"),
        ({"every": "60"}, "not str"),
        ({"every": 10, "grace": -1}, "grace must be >= 0"),
        ({"every": 10, "batch_size": 0}, "batch_size must be a positive int"),
    ],
)
def test_schedule_reaper_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    app = Celery("sched-bad", set_as_current=False)
    with pytest.raises(ConfigurationError, match=message):
        taskguard.schedule_reaper(app, **kwargs)
    assert SCHEDULE_KEY not in app.conf.beat_schedule


# -- end to end: worker + beat -------------------------------------------------------------


@pytest.mark.celery
@pytest.mark.slow
def test_beat_runs_the_reaper_in_a_real_worker(pg_url: str, tmp_path: Path) -> None:
    seed(pg_url, "expired:", 500, "-1 hour")
    seed(pg_url, "live:", 20, "1 hour", acquired="-1 minute")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
        "OPS_APP_DATABASE_URL": pg_url,
        "OPS_APP_BROKER": REDIS_URL,
        "OPS_APP_QUEUE": f"taskguard-reaper-test-{uuid.uuid4().hex[:8]}",
        "OPS_APP_REAPER_EVERY": "1",
        "OPS_APP_REAPER_GRACE": "60",
    }
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "ops_app", "worker", "--beat",
                "--schedule", str(tmp_path / "beat-schedule"), "--pool", "solo",
                "--loglevel", "INFO", "--queues", env["OPS_APP_QUEUE"],
                "--hostname", f"reaper-test-{uuid.uuid4().hex[:6]}@%h", "--without-mingle",
                "--without-gossip",
            ],
            cwd=TESTS_DIR, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 90
            while count(pg_url, "key LIKE 'expired:%'") and time.monotonic() < deadline:
                assert worker.poll() is None, log_path.read_text(errors="replace")
                time.sleep(0.5)
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=10)
    output = log_path.read_text(errors="replace")
    assert count(pg_url, "key LIKE 'expired:%'") == 0, output
    assert count(pg_url, "key LIKE 'live:%'") == 20
    assert "reaper removed 500 lock row(s)" in output, output
    assert "Sending due task taskguard-reaper (taskguard.reap_expired_locks)" in output
