"""Real prefork workers against production-shaped PostgreSQL (issue 13): through
PgBouncer in transaction pooling, the start-up check, and a primary whose
synchronous standby has stopped (a guarded task fails closed within the bound)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import REDIS_URL, drop_pg_database, new_pg_database
from integration.pgbouncer_fixtures import pgbouncer_tx  # noqa: F401 - fixture
from test_guarded_task_workers import RESULT_BACKEND, assert_no_overlap, runs
from tg_worker_app import RUNS_DDL, libpq_url, make_app
from workers import HERE, TESTS, start_worker, unique_queue

from taskguard import TaskGuard, is_skipped
from taskguard.config import reset_guards
from tests.harness.pgbouncer import PgBouncer
from tests.harness.postgres import ReplicatedPair

pytestmark = [pytest.mark.celery, pytest.mark.postgres]


@pytest.fixture
def worker_db(pg_template: str) -> Iterator[str]:
    url = new_pg_database(pg_template)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(RUNS_DDL)
    yield url
    reset_guards()
    drop_pg_database(url)


def test_duplicates_through_pgbouncer_transaction_pooling(
    worker_db: str,
    pgbouncer_tx: PgBouncer,  # noqa: F811
) -> None:
    """The acceptance scenario of the worker tests, every connection (the worker's
    guard, its reaper-free runs, the test's) through the pooler: 30 duplicates on 3
    keys, runs of one key never overlap, every submission ran or was skipped."""
    url = pgbouncer_tx.via(worker_db)
    queue = unique_queue("tg-pgb")
    app = make_app(REDIS_URL, RESULT_BACKEND, queue, url)
    try:
        with start_worker("tg_worker_app", REDIS_URL, url, 4, queue=queue,
                          result_backend=RESULT_BACKEND):  # fmt: skip
            slow = app.tasks["tg.slow"]
            keys = [f"pgb-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
            results = [slow.delay(keys[i % 3], 0.2) for i in range(30)]
            values = [r.get(timeout=90) for r in results]
    finally:
        app.close()
    ran = {r.id for r, v in zip(results, values, strict=True) if not is_skipped(v)}
    skipped = [v for v in values if is_skipped(v)]
    assert ran and skipped and len(ran) + len(skipped) == 30
    executed = []
    for kid in keys:
        found = runs(worker_db, kid)
        assert_no_overlap(found)
        executed += [run.task_id for run in found]
    assert sorted(executed) == sorted(ran)


def _worker_exit(db_url: str, env: dict[str, str], timeout: float = 60) -> tuple[int | None, str]:
    """Start a worker and wait for it to exit on its own (None if still running)."""
    queue = unique_queue("tg-check")
    child = dict(os.environ)
    child.update(
        {
            "TASKGUARD_DATABASE_URL": db_url,
            "TASKGUARD_TEST_BROKER_URL": REDIS_URL,
            "TASKGUARD_TEST_QUEUE": queue,
            "PYTHONPATH": os.pathsep.join([str(HERE), str(TESTS), child.get("PYTHONPATH", "")]),
            **env,
        }
    )
    cmd = [sys.executable, "-m", "celery", "-A", "tg_worker_app", "--broker", REDIS_URL,
           "worker", "-P", "prefork", "-c", "1", "--without-heartbeat", "--without-gossip",
           "--without-mingle", "-Q", queue, "-l", "INFO"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=child, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return None, out.decode(errors="replace")


def test_a_worker_on_an_unmigrated_database_stops_at_start(empty_pg_url: str) -> None:
    code, out = _worker_exit(empty_pg_url, {})
    assert code not in (None, 0), out[-3000:]
    line = next((x for x in out.splitlines() if "taskguard: " in x and "schema" in x), None)
    assert line is not None, out[-3000:]
    assert "taskguard db upgrade" in line and "stopping the worker" in line, line


def test_a_worker_logs_the_start_up_checks_ok_line_and_no_alembic_chatter(pg_url: str) -> None:
    """docs/operations.md: the check logs one line, ``ok`` included (issue 33), and
    nothing of Alembic's (issue 41, defect 8: about nine INFO lines, "setup plugin
    alembic.autogenerate.*", "Context impl ...", "Will assume transactional DDL")."""
    code, out = _worker_exit(pg_url, {}, timeout=20)
    assert code is None, out[-3000:]  # still running: we had to kill it
    assert ": ok (schema at " in out, out[-3000:]
    chatter = [
        line
        for line in out.splitlines()
        if any(s in line for s in ("alembic", "Context impl", "Will assume"))
    ]
    assert chatter == [], chatter


def test_a_worker_with_an_unreachable_database_starts_and_logs(empty_pg_url: str) -> None:
    """Default "stop" mode: an outage only logs (guarded tasks fail closed meanwhile)."""
    code, out = _worker_exit("postgresql+psycopg://postgres@127.0.0.1:1/nothing", {}, timeout=20)
    assert code is None, out[-3000:]  # still running: we had to kill it
    assert "database unreachable" in out and "stopping the worker" not in out, out[-3000:]


@pytest.mark.slow
def test_a_guarded_task_fails_closed_within_the_bound_when_the_standby_stops() -> None:
    bound = 2.0
    with ReplicatedPair(sync=True) as rp:
        assert rp.standby is not None
        url = rp.create_database("worker")
        with psycopg.connect(rp.primary.dsn("worker"), autocommit=True) as conn:
            conn.execute(RUNS_DDL)
        queue = unique_queue("tg-stall")
        app = make_app(REDIS_URL, RESULT_BACKEND, queue, url)
        try:
            with start_worker("tg_worker_app", REDIS_URL, url, 2, queue=queue,
                              result_backend=RESULT_BACKEND,
                              env={"TASKGUARD_TEST_CALL_TIMEOUT": str(bound)}) as worker:  # fmt: skip
                rp.standby.stop()
                t0 = time.monotonic()
                result = app.tasks["tg.slow"].delay("stalled", 0.1)
                # Failed closed, and put off until the database answers (issue 28 D).
                # The state as seen here: stopping the worker below may end a later
                # attempt that is still waiting on the stalled commit (WorkerLostError).
                while (state := result.state) != "RETRY" and time.monotonic() - t0 < 30:
                    time.sleep(0.05)
                took = time.monotonic() - t0
                log = worker.log_text()
        finally:
            app.close()
        print(f"guarded task failed closed and was deferred after {took:.2f}s")
        assert state == "RETRY", log[-3000:]
        assert "lock database unreachable before tg.slow" in log, log[-3000:]
        assert "OutcomeUnknown" in log or "could not be read back" in log, log[-3000:]
        assert took < bound + 3.0, (took, log[-3000:])
        # Failed closed: the body never ran.
        guard = TaskGuard(url)
        try:
            with psycopg.connect(rp.primary.dsn("worker"), autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FROM tg_runs").fetchone()
            assert row is not None and row[0] == 0
        finally:
            guard.dispose()


def test_a_worker_of_an_app_without_taskguard_is_not_checked(tmp_path: Path) -> None:
    """Installing taskguard (its ``celery taskguard`` command imports it into every
    ``celery`` process) must not stop a worker whose app uses none of it."""
    (tmp_path / "plainapp.py").write_text(
        "from celery import Celery\n"
        f"app = Celery('plain', broker={REDIS_URL!r})\n"
        "@app.task\n"
        "def add(x, y):\n"
        "    return x + y\n"
    )
    child = {k: v for k, v in os.environ.items() if not k.startswith("TASKGUARD_")}
    child["PYTHONPATH"] = str(tmp_path)
    cmd = [sys.executable, "-m", "celery", "-A", "plainapp", "worker", "-P", "solo",
           "--without-heartbeat", "--without-gossip", "--without-mingle",
           "-Q", unique_queue("tg-plain"), "-l", "INFO"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=child, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=30)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        code = None
    text = out.decode(errors="replace")
    assert code is None, text[-3000:]  # still running: we had to kill it
    assert "ready." in text and "start-up check" not in text, text[-3000:]
