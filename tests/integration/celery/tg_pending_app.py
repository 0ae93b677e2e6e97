"""Celery app for the coalesce / rate worker tests (``celery -A tg_pending_app worker``).

Locks live in ``TASKGUARD_DATABASE_URL`` (PostgreSQL or SQLite); every run is
recorded in ``tg_pending_runs`` of the PostgreSQL database ``TG_RUNS_URL``
(start/end by that server's clock, the argument it ran with), so one reader
serves both lock stores.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import billiard
import psycopg
from celery import Celery
from celery.signals import after_task_publish
from tg_worker_app import libpq_url
from workers import worker_settings

from taskguard import LeaseLost, check_lease, guarded_task, signals

RUNS_DDL = """
CREATE TABLE IF NOT EXISTS tg_pending_runs (
    id serial PRIMARY KEY,
    key_id text NOT NULL,
    task_id text NOT NULL,
    note text,
    pid int NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at timestamptz
)
"""

_local = threading.local()


def _conn(runs_url: str) -> psycopg.Connection[Any]:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed or getattr(_local, "pid", None) != os.getpid():
        conn = psycopg.connect(libpq_url(runs_url), autocommit=True)
        _local.conn, _local.pid = conn, os.getpid()
    return conn


def record(task: Any, runs_url: str, key_id: str, note: str, duration: float) -> str:
    conn = _conn(runs_url)
    row = conn.execute(
        "INSERT INTO tg_pending_runs (key_id, task_id, note, pid) VALUES (%s, %s, %s, %s) "
        "RETURNING id",
        (key_id, task.request.id, note, os.getpid()),
    ).fetchone()
    assert row is not None
    time.sleep(duration)
    conn.execute("UPDATE tg_pending_runs SET ended_at = clock_timestamp() WHERE id = %s", (row[0],))
    return note


#: A run with this note, deferred by a pool process, is slow to store its RETRY state:
#: the process sleeps this long after publishing the deferred copy (the race of a
#: loaded machine, made certain).
SLOW_RETRY_WRITE = "slow-retry-write"
SLOW_RETRY_SECONDS = 1.5


@after_task_publish.connect(weak=False, dispatch_uid="tg_pending_app.slow_retry_write")
def _slow_retry_write(body: Any = None, **_: Any) -> None:
    args = body[0] if isinstance(body, (list, tuple)) and body else ()
    in_pool = billiard.current_process().name.startswith("ForkPoolWorker")
    if in_pool and len(args) > 1 and args[1] == SLOW_RETRY_WRITE:
        time.sleep(SLOW_RETRY_SECONDS)


#: Keys whose lease the ``lease_lost`` signal declared lost in this process.
_lost: set[str] = set()


@signals.lease_lost.connect
def _record_loss(sender: Any = None, key: str = "", **_: Any) -> None:
    _lost.add(key)


def hold_the_gil(seconds: float) -> None:
    """One C call that keeps the GIL ``seconds`` long (no bytecode runs meanwhile,
    in no thread of this process): ``sum(range(n))``, ``n`` measured first."""
    n, took = 1_000_000, 0.0
    while took < 0.1:
        n *= 2
        took = min(_timed(sum, range(n)) for _ in range(3))  # the least disturbed of 3
    sum(range(int(n * seconds / took)))


def _timed(call: Any, *args: Any) -> float:
    began = time.perf_counter()
    call(*args)
    return time.perf_counter() - began


def make_app(
    broker_url: str, result_backend: str | None, queue: str, database_url: str, runs_url: str
) -> Celery:
    """The app (tasks registered) for these settings."""
    app = Celery("tg_pending_app", set_as_current=False)
    # taskguard_history: the rate test reads the slots' grants by the database clock.
    app.conf.update(
        worker_settings(broker_url, result_backend, queue, database_url, taskguard_history=True)
    )

    @guarded_task(
        app=app, shared=False, name="tgp.coalesce", key="co:{key_id}", ttl=3,
        on_conflict="coalesce", bind=True,
    )  # fmt: skip
    def coalesce(self: Any, key_id: str, note: str = "", duration: float = 0.0) -> str:
        return record(self, runs_url, key_id, note, duration)

    @guarded_task(
        app=app, shared=False, name="tgp.coalesce_replace", key="cr:{key_id}", ttl=3,
        on_conflict="coalesce", coalesce_replace=True, bind=True,
    )  # fmt: skip
    def coalesce_replace(self: Any, key_id: str, note: str = "", duration: float = 0.0) -> str:
        return record(self, runs_url, key_id, note, duration)

    @guarded_task(
        app=app, shared=False, name="tgp.rated", key="rate:{key_id}", ttl=3, limit=4,
        rate="3/2s", bind=True,
    )  # fmt: skip
    def rated(self: Any, key_id: str, note: str = "", duration: float = 0.0) -> str:
        return record(self, runs_url, key_id, note, duration)

    @guarded_task(app=app, shared=False, name="tgp.held", key="held:{key_id}", ttl=30, bind=True)
    def held(self: Any, key_id: str, note: str = "", duration: float = 0.0) -> str:
        return record(self, runs_url, key_id, note, duration)

    @guarded_task(app=app, shared=False, name="tgp.gil", key="gil:{key_id}", ttl=2, bind=True)
    def gil(self: Any, key_id: str, seconds: float) -> str:
        """Holds the GIL past its ttl; says what the run learnt once Python ran again."""
        conn = _conn(runs_url)
        row = conn.execute(
            "INSERT INTO tg_pending_runs (key_id, task_id, note, pid) VALUES (%s, %s, %s, %s) "
            "RETURNING id",
            (key_id, self.request.id, "holding the GIL", os.getpid()),
        ).fetchone()
        assert row is not None
        hold_the_gil(seconds)
        try:
            check_lease()
            learnt = "held"
        except LeaseLost as exc:
            learnt = f"check_lease: {exc}"
        deadline = time.monotonic() + 5.0  # the renewer thread declares it too
        while f"gil:{key_id}" not in _lost and time.monotonic() < deadline:
            time.sleep(0.01)
        learnt += "; lease_lost sent" if f"gil:{key_id}" in _lost else "; no lease_lost"
        conn.execute(
            "UPDATE tg_pending_runs SET ended_at = clock_timestamp(), note = %s WHERE id = %s",
            (learnt, row[0]),
        )
        return learnt

    @guarded_task(
        app=app, shared=False, name="tgp.rate_only", key="ro:{key_id}", ttl=3, rate="3/2s",
        bind=True,
    )  # fmt: skip
    def rate_only(self: Any, key_id: str, note: str = "", duration: float = 0.0) -> str:
        return record(self, runs_url, key_id, note, duration)

    @guarded_task(
        app=app, shared=False, name="tgp.debounced", key="db:{key_id}", ttl=3, debounce=1,
        bind=True,
    )  # fmt: skip
    def debounced(self: Any, key_id: str, note: str = "", duration: float = 0.0) -> str:
        return record(self, runs_url, key_id, note, duration)

    @guarded_task(
        app=app, shared=False, name="tgp.debounced_max", key="dm:{key_id}", ttl=3, debounce=1,
        debounce_max=1.5, bind=True,
    )  # fmt: skip
    def debounced_max(self: Any, key_id: str, note: str = "", duration: float = 0.0) -> str:
        return record(self, runs_url, key_id, note, duration)

    return app


app = make_app(
    broker_url=os.environ.get("TASKGUARD_TEST_BROKER_URL", "memory://"),
    result_backend=os.environ.get("TASKGUARD_TEST_RESULT_BACKEND") or None,
    queue=os.environ.get("TASKGUARD_TEST_QUEUE", "tg_pending_app"),
    database_url=os.environ.get("TASKGUARD_DATABASE_URL", ""),
    runs_url=os.environ.get("TG_RUNS_URL", ""),
)
