"""Celery app for the @guarded_task worker tests.

A worker process imports this module (``celery -A tg_worker_app worker``) and
builds its app from the environment (see ``workers.start_worker``); the test
process calls :func:`make_app` with the same settings to publish. Every guarded
task records each execution (start/end by the database clock, pid, lease token,
retry number) in ``tg_runs`` of the test database, so tests can check that runs
of one key never overlap.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from celery import Celery
from sqlalchemy.engine import make_url
from workers import worker_settings

from taskguard import current_lease, guarded_task

RUNS_DDL = """
CREATE TABLE IF NOT EXISTS tg_runs (
    id serial PRIMARY KEY,
    task text NOT NULL,
    key_id text NOT NULL,
    task_id text NOT NULL,
    retries int NOT NULL,
    token bigint,
    pid int NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at timestamptz
)
"""

#: MariaDB: the same table; times by the database clock in UTC.
RUNS_DDL_MARIADB = """
CREATE TABLE IF NOT EXISTS tg_runs (
    id INT AUTO_INCREMENT PRIMARY KEY,
    task VARCHAR(255) NOT NULL,
    key_id VARCHAR(255) NOT NULL,
    task_id VARCHAR(255) NOT NULL,
    retries INT NOT NULL,
    token BIGINT,
    pid INT NOT NULL,
    started_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    ended_at DATETIME(6)
)
"""

_local = threading.local()


def libpq_url(url: str) -> str:
    """A SQLAlchemy PostgreSQL URL as a plain libpq URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _mariadb(url: str) -> bool:
    return make_url(url).get_backend_name() in ("mysql", "mariadb")


def runs_connection(url: str) -> Any:
    """A plain autocommit DBAPI connection to the test database (psycopg or MySQLdb)."""
    if _mariadb(url):
        import MySQLdb

        u = make_url(url)
        return MySQLdb.connect(
            host=u.host, port=u.port or 3306, user=u.username, password=u.password or "",
            database=u.database, autocommit=True,
        )  # fmt: skip
    return psycopg.connect(libpq_url(url), autocommit=True, prepare_threshold=None)


class _MariaConn:
    """psycopg's ``conn.execute(sql, params)`` on a MySQLdb connection."""

    def __init__(self, url: str) -> None:
        self._conn = runs_connection(url)
        self.closed = False

    def execute(self, sql: str, params: Any = None) -> Any:
        cur = self._conn.cursor()
        cur.execute(sql.replace("clock_timestamp()", "UTC_TIMESTAMP(6)"), params)
        return cur


def _conn() -> Any:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed or getattr(_local, "pid", None) != os.getpid():
        url = os.environ["TASKGUARD_DATABASE_URL"]
        # prepare_threshold=None: the URL may go through PgBouncer (transaction pooling).
        conn = _MariaConn(url) if _mariadb(url) else runs_connection(url)
        _local.conn, _local.pid = conn, os.getpid()
    return conn


def record(task: Any, key_id: str, duration: float, *, keep_open: bool = False) -> int:
    """Record a run of ``task`` while sleeping ``duration`` seconds; returns its token
    (with ``keep_open``: the row's id, and the caller sets ``ended_at``)."""
    lease = current_lease(check=False)
    token = lease.token if lease is not None else None
    request = task.request
    row = (
        _conn()
        .execute(
            "INSERT INTO tg_runs (task, key_id, task_id, retries, token, pid) "
            "VALUES (%s, %s, %s, %s, %s, %s) RETURNING id",
            # PostgreSQL text cannot hold NUL; Celery task ids can.
            (
                task.name,
                key_id,
                request.id.replace("\x00", "\\0"),
                request.retries,
                token,
                os.getpid(),
            ),
        )
        .fetchone()
    )
    assert row is not None
    if keep_open:
        return int(row[0])
    time.sleep(duration)
    _conn().execute("UPDATE tg_runs SET ended_at = clock_timestamp() WHERE id = %s", (row[0],))
    return token or 0


def visibility_from_environment(app: Celery) -> None:
    """Redis: unacked messages come back after ``TASKGUARD_TEST_VISIBILITY_TIMEOUT``
    seconds (when set), looked for every 0.5 s (kombu's default: every 10 s)."""
    visibility = os.environ.get("TASKGUARD_TEST_VISIBILITY_TIMEOUT")
    if visibility:
        app.conf.broker_transport_options = {
            "visibility_timeout": float(visibility),
            "unacked_restore_interval": 0.5,
            "unacked_restore_throttle": 1,
        }


def make_app(broker_url: str, result_backend: str | None, queue: str, database_url: str) -> Celery:
    """The app (tasks registered) for these settings."""
    app = Celery("tg_worker_app", set_as_current=False)
    app.conf.update(
        worker_settings(
            broker_url,
            result_backend,
            queue,
            database_url,
            taskguard_engine_options={"pool_size": 2, "max_overflow": 3},
        )
    )
    if os.environ.get("TASKGUARD_TEST_CALL_TIMEOUT"):
        app.conf.taskguard_call_timeout = float(os.environ["TASKGUARD_TEST_CALL_TIMEOUT"])
    retention = os.environ.get("TASKGUARD_TEST_FINISHED_RETENTION")
    if retention:
        app.conf.taskguard_finished_retention = float(retention)
    visibility_from_environment(app)

    @guarded_task(app=app, shared=False, name="tg.slow", key="slow:{key_id}", ttl=3, bind=True)
    def slow(self: Any, key_id: str, duration: float = 0.3) -> int:
        return record(self, key_id, duration)

    @guarded_task(
        app=app,
        shared=False,
        name="tg.queued",
        key="queued:{key_id}",
        ttl=3,
        lock="queue_and_run",
        on_conflict="raise",
        bind=True,
    )
    def queued(self: Any, key_id: str, duration: float = 0.0) -> int:
        return record(self, key_id, duration)

    @guarded_task(app=app, shared=False, name="tg.long", key="long:{key_id}", ttl=1.5, bind=True)
    def long(self: Any, key_id: str, duration: float) -> int:
        return record(self, key_id, duration)

    @guarded_task(
        app=app,
        shared=False,
        name="tg.retrying",
        key="retrying:{key_id}",
        ttl=3,
        bind=True,
        max_retries=5,
    )
    def retrying(self: Any, key_id: str, retries_wanted: int) -> int:
        token = record(self, key_id, 0.3)
        if self.request.retries < retries_wanted:
            raise self.retry(countdown=0.5)
        return token

    @guarded_task(
        app=app,
        shared=False,
        name="tg.patient",
        key="slow:{key_id}",  # tg.slow's key: the two conflict
        ttl=3,
        on_conflict="retry",
        retry_countdown=0.3,
        max_retries=30,
        bind=True,
    )
    def patient(self: Any, key_id: str) -> int:
        return record(self, key_id, 0.0)

    @guarded_task(
        app=app, shared=False, name="tg.sleeper", key="sleeper:{key_id}", ttl=30, bind=True
    )
    def sleeper(self: Any, key_id: str, duration: float) -> int:
        return record(self, key_id, duration)

    @guarded_task(
        app=app,
        shared=False,
        name="tg.short_ttl",
        key="short:{key_id}",
        ttl=2,
        bind=True,
        acks_late=True,
    )
    def short_ttl(self: Any, key_id: str, duration: float) -> int:
        # acks_late: a killed worker's message is redelivered; that copy does not sleep.
        redelivered = (self.request.delivery_info or {}).get("redelivered")
        return record(self, key_id, 0 if redelivered else duration)

    @guarded_task(app=app, shared=False, name="tg.stubborn", key="stubborn:{key_id}", ttl=30)
    def stubborn(key_id: str, duration: float) -> None:
        # Swallows the SIGTERM billiard sends on a hard time limit (SystemExit),
        # so it has to be SIGKILLed: its finally never releases.
        try:
            record(stubborn, key_id, duration)
        except BaseException:
            time.sleep(duration)

    @guarded_task(
        app=app,
        shared=False,
        name="tg.acked_late",
        key="late:{key_id}",
        ttl=3,
        acks_late=True,
        bind=True,
    )
    def acked_late(self: Any, key_id: str, duration: float) -> int:
        return record(self, key_id, duration)

    @app.task(shared=False, name="tg.echo")
    def echo(value: Any = None) -> Any:
        return value

    @app.task(shared=False, name="tg.collect")
    def collect(values: Any) -> Any:
        return values

    # One queue-phase task per conflict strategy, all on the key "canvas:{key_id}".
    for strategy in ("skip", "raise", "retry", "existing"):
        _queue_task(app, strategy)

    @guarded_task(
        app=app,
        shared=False,
        name="tg.stoppable",
        key="stoppable:{key_id}",
        ttl=1.5,
        stop_on_lease_loss=True,
        bind=True,
    )
    def stoppable(self: Any, key_id: str, duration: float) -> int:
        try:
            return record(self, key_id, duration)
        except BaseException:
            # Stopped mid-body: when, by the database clock.
            _conn().execute(
                "UPDATE tg_runs SET ended_at = clock_timestamp() "
                "WHERE key_id = %s AND ended_at IS NULL",
                (key_id,),
            )
            raise

    @guarded_task(
        app=app,
        shared=False,
        name="tg.stoppable_steps",
        key="stoppable:{key_id}",
        ttl=1.5,
        stop_on_lease_loss=True,
        bind=True,
    )
    def stoppable_steps(self: Any, key_id: str, duration: float) -> int:
        # Short sleeps: a threads-pool body is interrupted between bytecodes only.
        return _in_steps(self, key_id, duration)

    @guarded_task(
        app=app,
        shared=False,
        name="tg.waiter",
        key="wave:{key_id}",
        ttl=10,
        on_conflict="wait",
        wait_timeout=60,
        bind=True,
    )
    def waiter(self: Any, key_id: str, duration: float) -> int:
        return record(self, key_id, duration)

    return app


def _in_steps(task: Any, key_id: str, duration: float) -> int:
    row_id = record(task, key_id, 0.0, keep_open=True)
    try:
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        # Ended (or stopped mid-body): when, by the database clock.
        _conn().execute("UPDATE tg_runs SET ended_at = clock_timestamp() WHERE id = %s", (row_id,))
    return row_id


def _queue_task(app: Celery, strategy: str) -> None:
    def body(self: Any, key_id: str, value: Any = None) -> Any:
        record(self, key_id, 0.0)
        return value if value is not None else strategy

    body.__name__ = f"queued_{strategy}"
    extra: dict[str, Any] = {"retry_countdown": 0.5} if strategy == "retry" else {}
    guarded_task(
        app=app,
        shared=False,
        name=f"tg.queued_{strategy}",
        key="canvas:{key_id}",
        ttl=3,
        lock="queue",
        on_conflict=strategy,
        max_retries=60,
        bind=True,
        **extra,
    )(body)


def _from_environment() -> Celery:
    return make_app(
        broker_url=os.environ.get("TASKGUARD_TEST_BROKER_URL", "memory://"),
        result_backend=os.environ.get("TASKGUARD_TEST_RESULT_BACKEND") or None,
        queue=os.environ.get("TASKGUARD_TEST_QUEUE", "tg_worker_app"),
        database_url=os.environ.get("TASKGUARD_DATABASE_URL", ""),
    )


app = _from_environment()
