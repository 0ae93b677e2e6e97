"""Shared pieces: result rows, statistics, scratch databases, Redis prefixes, child
processes, the Celery workers of the benchmark apps."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from taskguard import schema

SCRIPTS = Path(__file__).resolve().parents[1]

#: Databases this process created and has not dropped yet (dropped on the way out).
_LIVE_DATABASES: set[str] = set()


@dataclass
class Env:
    """Where the services are and how big to make the run."""

    pg_url: (
        str  # SQLAlchemy URL of any database on the server (the admin connection uses `postgres`)
    )
    redis_url: str
    amqp_url: str
    quick: bool
    #: SQLAlchemy URL of any database on the MariaDB server (scratch databases are made there).
    mariadb_url: str = field(
        default_factory=lambda: os.environ.get(
            "TASKGUARD_BENCH_MARIADB_URL", "mysql://root@127.0.0.1:3306/mysql"
        )
    )
    run_id: str = field(default_factory=lambda: f"{os.getpid()}_{uuid.uuid4().hex[:6]}")

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    @property
    def redis_prefix(self) -> str:
        return f"tgbench:{self.run_id}:"


@dataclass
class Row:
    """One line of the results table."""

    id: str
    section: str
    label: str
    unit: str = "pairs/s"
    rate: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    #: Row id this one is compared with, and how: "cost" (ref rate / rate: how many times the
    #: reference's time per operation), "rate" (rate / ref rate), "p50" / "p99" (latency ratio).
    ref: str | None = None
    ratio_kind: str = "cost"
    ratio: float | None = None
    status: str = "ok"  # "ok", "not run: <reason>", "error: <reason>", "failed: <reason>"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def not_run(rows: Sequence[Row], reason: str, *, error: bool = False) -> list[Row]:
    """Mark every row of a section that could not be measured, saying why."""
    for row in rows:
        row.status = f"{'error' if error else 'not run'}: {reason}"
    return list(rows)


def mark_failed(rows: Sequence[Row], reason: str) -> None:
    """Rows whose contestant's task raised: the reason instead of their figures."""
    for row in rows:
        row.status, row.note, row.extra = f"failed: {reason}", "", {}
        row.rate = row.p50_ms = row.p99_ms = row.ratio = None


# -- statistics -------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty sequence."""
    if not sorted_values:
        raise ValueError("no samples")
    rank = max(1, min(len(sorted_values), round(q / 100.0 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def latency_ms(samples_ns: Sequence[int]) -> tuple[float, float]:
    """(p50, p99) in milliseconds."""
    ordered = sorted(samples_ns)
    return percentile(ordered, 50) / 1e6, percentile(ordered, 99) / 1e6


# -- PostgreSQL -----------------------------------------------------------------------------


def libpq_url(url: str, database: str | None = None) -> str:
    """A SQLAlchemy URL as a plain libpq URL (for psycopg and pgbench)."""
    u = make_url(url)
    if database is not None:
        u = u.set(database=database)
    return u.set(drivername="postgresql").render_as_string(hide_password=False)


def admin(env: Env) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq_url(env.pg_url, "postgres"), autocommit=True, connect_timeout=10)


def drop_database(env: Env, name: str) -> None:
    with admin(env) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    _LIVE_DATABASES.discard(name)


@contextlib.contextmanager
def scratch_db(env: Env, tag: str, *, migrate: bool = True) -> Iterator[str]:
    """A fresh database for one benchmark (migrated with taskguard.schema.upgrade);
    yields its SQLAlchemy URL and drops it afterwards, whatever happens."""
    name = f"tgbench_{tag}_{env.run_id}"
    with admin(env) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    _LIVE_DATABASES.add(name)
    try:
        url = make_url(env.pg_url).set(database=name).render_as_string(hide_password=False)
        if migrate:
            schema.upgrade(url)
        yield url
    finally:
        drop_database(env, name)


def maria_admin(env: Env) -> Any:
    import MySQLdb

    u = make_url(env.mariadb_url)
    return MySQLdb.connect(
        host=u.host or "127.0.0.1", port=u.port or 3306, user=u.username or "root",
        password=u.password or "", autocommit=True, connect_timeout=10,
    )  # fmt: skip


@contextlib.contextmanager
def maria_scratch_db(env: Env, tag: str) -> Iterator[str]:
    """A fresh, migrated MariaDB database for one benchmark; yields its URL, drops it after."""
    name = f"tgbench_{tag}_{env.run_id}"
    conn = maria_admin(env)
    try:
        conn.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
        conn.cursor().execute(f"CREATE DATABASE `{name}`")
        url = make_url(env.mariadb_url).set(database=name).render_as_string(hide_password=False)
        schema.upgrade(url)
        yield url
    finally:
        conn.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
        conn.close()


def drop_leftovers(env: Env) -> None:
    """Drop every scratch database still registered (after an interrupt)."""
    for name in list(_LIVE_DATABASES):
        with contextlib.suppress(Exception):
            drop_database(env, name)


def server_facts(env: Env) -> dict[str, Any]:
    """PostgreSQL version and the settings that change what the figures mean."""
    with admin(env) as conn:
        facts: dict[str, Any] = {
            "server_version": conn.execute("SHOW server_version").fetchone()[0],  # type: ignore[index]
        }
        for name in ("synchronous_commit", "fsync", "autovacuum", "shared_buffers", "wal_level"):
            facts[name] = conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
    return facts


# -- Redis ------------------------------------------------------------------------------------


def redis_cleanup(env: Env) -> int:
    """Delete every key this run created (they all start with env.redis_prefix)."""
    import redis

    client = redis.Redis.from_url(env.redis_url)
    try:
        keys = list(client.scan_iter(match=env.redis_prefix + "*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
        return len(keys)
    finally:
        client.close()


def failed_tasks(redis_url: str, prefix: str) -> dict[str, str]:
    """Task name -> "<exception type>: <message>" of its first run that raised, as the
    benchmark workers record them (the hash ``<prefix>failed``)."""
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return client.hgetall(f"{prefix}failed")  # type: ignore[return-value]
    finally:
        client.close()


# -- child processes ------------------------------------------------------------------------


def run_children(
    target: Callable[..., Any], args_list: Sequence[tuple[Any, ...]], timeout: float
) -> list[Any]:
    """Run ``target(queue, *args)`` in one forked process per args tuple; collect one result
    each from the queue. Children still alive after ``timeout`` are terminated, then killed."""
    ctx = mp.get_context("fork")
    queue: Any = ctx.Queue()
    procs = [ctx.Process(target=target, args=(queue, *args), daemon=True) for args in args_list]
    for p in procs:
        p.start()
    results: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                results.append(queue.get(timeout=0.5))
            if len(results) < len(procs) and not any(p.is_alive() for p in procs):
                # Everyone exited; drain what is left, then stop waiting.
                with contextlib.suppress(Exception):
                    while len(results) < len(procs):
                        results.append(queue.get(timeout=1.0))
                break
    finally:
        stop_children(procs)
    if len(results) < len(procs):
        raise RuntimeError(
            f"{len(procs) - len(results)} of {len(procs)} child processes gave no result"
        )
    return results


def stop_children(procs: Sequence[Any], grace: float = 5.0) -> None:
    """Join children; terminate and then kill those that do not exit in time."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


def now_ns() -> int:
    return time.perf_counter_ns()


# -- Celery workers ---------------------------------------------------------------------------


def start_worker(
    app: str,
    name: str,
    concurrency: int,
    log: Any,
    *,
    core: int | None = None,
    queue: str | None = None,
    environ: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``celery -A benchlib.<app> worker`` with ``concurrency`` prefork pool processes, in
    a process group of its own, writing to the open file ``log``; pinned to CPU ``core``
    with taskset and consuming only ``queue`` when given, ``environ`` added to its own."""
    cmd = [] if core is None else ["taskset", "-c", str(core)]
    cmd += [sys.executable, "-m", "celery", "-A", f"benchlib.{app}", "worker"]
    cmd += ["-P", "prefork", "-c", str(concurrency), "-l", "WARNING", "-n", f"{name}@%h"]
    cmd += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    cmd += ["-Q", queue] if queue else []
    # The repo root too: benchlib imports tests.harness (private servers).
    path = os.pathsep.join([str(SCRIPTS), str(SCRIPTS.parent), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(
        cmd,
        cwd=SCRIPTS,
        env={**os.environ, **(environ or {}), "PYTHONPATH": path},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    """Warm shutdown of the worker's process group; killed if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # any pool child left behind
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def wait_count(
    r: Any, key: str, target: int, timeout: float, proc: subprocess.Popen[bytes]
) -> float:
    """Poll a Redis counter the worker raises until it reaches ``target``; returns when."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if int(r.get(key) or 0) >= target:
            return time.monotonic()
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with code {proc.returncode}")
        time.sleep(0.005)
    raise TimeoutError(f"{key} stayed below {target} for {timeout:.0f} s")
