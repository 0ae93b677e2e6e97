"""Section 1: acquire+release pairs on one connection, against the floor and the alternatives.

Every contestant runs in the same process, interleaved round by round (the order
rotates each round), so load from other processes on the machine lands on all of
them alike and the ratios stay meaningful even when absolute figures drift.
"""

from __future__ import annotations

import gc
import os
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from benchlib import cpu
from benchlib.common import (
    Env,
    Row,
    latency_ms,
    libpq_url,
    maria_scratch_db,
    not_run,
    now_ns,
    scratch_db,
)
from taskguard import TaskGuard
from taskguard.dialects import lock_sql_for
from tests.harness.pgbouncer import PgBouncer

TTL = 60.0
# On a direct connection taskguard prepares named statements (psycopg's threshold, 5);
# through a pooler it sends unnamed ones. A threshold never reached forces the latter
# here, to show what the pooler-safe mode costs on the same connection.
UNNAMED: dict[str, Any] = {"connect_args": {"prepare_threshold": 2**31 - 1}}
# psycopg's own threshold, forced: named statements through a pooler, which only a
# PgBouncer >= 1.21 with max_prepared_statements set keeps apart per client.
NAMED: dict[str, Any] = {"connect_args": {"prepare_threshold": 5}}
#: A pgbouncer >= 1.21 binary (the Debian one is 1.18): the row behind it runs only when set.
PREPARED_BIN_VAR = "TASKGUARD_BENCH_PGBOUNCER_PREPARED_BIN"


class Contestant:
    """One way of taking and giving back a lock; ``pair()`` must raise if not granted.

    A contestant on PostgreSQL names its connections ``app_name`` (its
    ``application_name``): their backends' CPU is then measured too."""

    def __init__(self, row: Row) -> None:
        self.row = row
        self.app_name: str | None = None

    def pair(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class PgSelectOne(Contestant):
    """The floor: two prepared ``SELECT 1`` round trips (no write, no commit)."""

    def __init__(self, row: Row, url: str) -> None:
        super().__init__(row)
        self.conn = _pg_connect(self, url)
        self.cur = self.conn.cursor()

    def pair(self) -> None:
        cur = self.cur
        cur.execute("SELECT 1", prepare=True)
        cur.fetchone()
        cur.execute("SELECT 1", prepare=True)
        cur.fetchone()

    def close(self) -> None:
        self.conn.close()


class RawSql(Contestant):
    """taskguard's own acquire and release SQL text, issued by hand with psycopg, prepared."""

    def __init__(self, row: Row, url: str, *, durable: bool) -> None:
        super().__init__(row)
        from sqlalchemy import create_engine

        engine = create_engine(url)
        sql = lock_sql_for(engine.dialect)
        engine.dispose()
        self.acquire, self.release = sql.acquire, sql.release
        self.conn = _pg_connect(self, url)
        if not durable:
            self.conn.execute("SET synchronous_commit TO off")
        self.cur = self.conn.cursor()
        self.key = f"bench:pair:{row.id}"
        self.hostname, self.pid = socket.gethostname(), os.getpid()

    def pair(self, key: str | None = None) -> None:
        """Acquire and release ``key`` (default: this contestant's own key)."""
        key = self.key if key is None else key
        cur, owner = self.cur, uuid.uuid4().hex
        holder = {"task_name": None, "task_id": None, "hostname": self.hostname, "pid": self.pid}
        values = {
            "key": key,
            "slot": 0,
            "n": 1,
            "phase": "run",
            "owner": owner,
            "ttl": TTL,
            **holder,
        }
        cur.execute(self.acquire.sql, self.acquire.params(values), prepare=True)
        if cur.fetchone() is None:
            raise RuntimeError(f"raw acquire of {key} was not granted")
        release = self.release
        cur.execute(
            release.sql, release.params({"key": key, "slot": 0, "owner": owner}), prepare=True
        )
        if cur.rowcount != 1:
            raise RuntimeError(f"raw release of {key} matched {cur.rowcount} rows")

    def close(self) -> None:
        self.conn.close()


#: The minimal correct lock (issue 29's anchor): an upsert that takes the row only
#: when its lease ended, a fresh fencing token from the same sequence, and a release
#: that checks the owner. No waiters, limits, markers, holder details or holder read.
#: Durable like taskguard's: the grant waits for the WAL flush, the release does not
#: (a lost release only keeps the key until its expiry), in the statement itself.
MINIMAL_ACQUIRE = """
INSERT INTO task_locks AS t (key, slot, owner, token, acquired_at, expires_at)
VALUES (%(key)s, 0, %(owner)s, nextval('task_locks_token_seq'), statement_timestamp(),
        statement_timestamp() + %(ttl)s * interval '1 second')
ON CONFLICT (key, slot) DO UPDATE
SET owner = excluded.owner, token = nextval('task_locks_token_seq'),
    acquired_at = excluded.acquired_at, expires_at = excluded.expires_at
WHERE t.expires_at <= statement_timestamp()
RETURNING t.token
"""
MINIMAL_RELEASE = """
UPDATE task_locks SET expires_at = statement_timestamp()
WHERE key = %(key)s AND slot = 0 AND owner = %(owner)s AND expires_at > statement_timestamp()
  AND set_config('synchronous_commit', 'off', true) IS NOT NULL
"""


class MinimalLock(Contestant):
    """The minimal correct lock by hand (:data:`MINIMAL_ACQUIRE`, :data:`MINIMAL_RELEASE`),
    prepared, durable, on the same table: the floor taskguard's pair is held to."""

    def __init__(self, row: Row, url: str) -> None:
        super().__init__(row)
        self.conn = _pg_connect(self, url)
        self.cur = self.conn.cursor()
        self.key = f"bench:pair:{row.id}"

    def pair(self, key: str | None = None) -> None:
        """Acquire and release ``key`` (default: this contestant's own key)."""
        key = self.key if key is None else key
        cur = self.cur
        owner = uuid.uuid4().hex
        cur.execute(MINIMAL_ACQUIRE, {"key": key, "owner": owner, "ttl": TTL}, prepare=True)
        if cur.fetchone() is None:
            raise RuntimeError(f"minimal acquire of {key} was not granted")
        cur.execute(MINIMAL_RELEASE, {"key": key, "owner": owner}, prepare=True)
        if cur.rowcount != 1:
            raise RuntimeError(f"minimal release of {key} matched {cur.rowcount} rows")

    def close(self) -> None:
        self.conn.close()


def _pg_connect(contestant: Contestant, url: str) -> psycopg.Connection[Any]:
    """An autocommit psycopg connection named after the contestant's row."""
    contestant.app_name = f"tgbench:{contestant.row.id}"
    return psycopg.connect(libpq_url(url), autocommit=True, application_name=contestant.app_name)


class TaskGuardPair(Contestant):
    """taskguard through its public API (``engine_kwargs`` go to TaskGuard)."""

    def __init__(
        self, row: Row, url: str, *, durable: bool, named: bool = True, **engine_kwargs: Any
    ) -> None:
        super().__init__(row)
        connect_args = dict(engine_kwargs.pop("connect_args", {}))
        if named and url.startswith("postgresql"):
            self.app_name = connect_args["application_name"] = f"tgbench:{row.id}"
        if connect_args:
            engine_kwargs["connect_args"] = connect_args
        self.guard = TaskGuard(url, durable=durable, **engine_kwargs)
        self.key = f"bench:pair:{row.id}"

    def pair(self) -> None:
        lease = self.guard.acquire(self.key, TTL)
        if lease is None:
            raise RuntimeError(f"taskguard acquire of {self.key} was not granted")
        if not self.guard.release(lease):
            raise RuntimeError(f"taskguard release of {self.key} returned False")

    def close(self) -> None:
        self.guard.dispose()


class MariaSelectOne(Contestant):
    """The MariaDB floor: two ``SELECT 1`` round trips on mysqlclient (no write, no commit)."""

    def __init__(self, row: Row, url: str) -> None:
        super().__init__(row)
        self.conn = _maria_connect(url)
        self.cur = self.conn.cursor()

    def pair(self) -> None:
        cur = self.cur
        cur.execute("SELECT 1")
        cur.fetchall()
        cur.execute("SELECT 1")
        cur.fetchall()

    def close(self) -> None:
        self.conn.close()


def _maria_connect(url: str, driver: str = "mysqlclient") -> Any:
    import MySQLdb
    import pymysql

    from taskguard.dialects.mariadb import SESSION_SETUP

    u = make_url(url)
    conn = (MySQLdb if driver == "mysqlclient" else pymysql).connect(
        host=u.host or "127.0.0.1", port=u.port or 3306, user=u.username or "root",
        password=u.password or "", database=u.database, charset="utf8mb4", autocommit=True,
    )  # fmt: skip
    cur = conn.cursor()
    for stmt in SESSION_SETUP:  # the session taskguard's own connections get
        cur.execute(stmt)
    cur.close()
    return conn


class MariaRawSql(Contestant):
    """taskguard's MariaDB acquire and release SQL text, issued by hand with mysqlclient:
    the one-statement upsert (granted iff RETURNING shows our owner) and the release."""

    def __init__(self, row: Row, url: str, driver: str = "mysqlclient") -> None:
        super().__init__(row)
        from sqlalchemy import create_engine

        engine = create_engine(url)
        sql = lock_sql_for(engine.dialect)
        engine.dispose()
        self.acquire, self.release = sql.acquire, sql.release
        self.conn = _maria_connect(url, driver)
        self.cur = self.conn.cursor()
        self.key = f"bench:pair:{row.id}"
        self.hostname, self.pid = socket.gethostname(), os.getpid()

    def pair(self) -> None:
        cur = self.cur
        owner = uuid.uuid4().hex
        values = {
            "key": self.key, "slot": 0, "n": 1, "phase": "run", "owner": owner, "ttl": int(TTL * 1e6),
            "task_name": None, "task_id": None, "hostname": self.hostname, "pid": self.pid,
        }  # fmt: skip
        cur.execute(self.acquire.sql, self.acquire.params(values))
        got = cur.fetchone()
        if got is None or got[0] != owner:
            raise RuntimeError(f"raw acquire of {self.key} was not granted")
        release = self.release
        cur.execute(release.sql, release.params({"key": self.key, "slot": 0, "owner": owner}))
        if cur.rowcount != 1:
            raise RuntimeError(f"raw release of {self.key} matched {cur.rowcount} rows")

    def close(self) -> None:
        self.conn.close()


class PgAdvisory(Contestant):
    """Session-level advisory lock: ``pg_try_advisory_lock`` + ``pg_advisory_unlock``."""

    def __init__(self, row: Row, url: str) -> None:
        super().__init__(row)
        self.conn = _pg_connect(self, url)
        self.cur = self.conn.cursor()

    def pair(self) -> None:
        cur = self.cur
        cur.execute("SELECT pg_try_advisory_lock(%s)", (42,), prepare=True)
        if not cur.fetchone()[0]:  # type: ignore[index]
            raise RuntimeError("advisory lock not granted")
        cur.execute("SELECT pg_advisory_unlock(%s)", (42,), prepare=True)
        if not cur.fetchone()[0]:  # type: ignore[index]
            raise RuntimeError("advisory unlock found no lock")

    def close(self) -> None:
        self.conn.close()


class RedisPing(Contestant):
    """Redis floor: two PING round trips."""

    def __init__(self, row: Row, env: Env) -> None:
        super().__init__(row)
        import redis

        self.client = redis.Redis.from_url(env.redis_url)

    def pair(self) -> None:
        self.client.ping()
        self.client.ping()

    def close(self) -> None:
        self.client.close()


class CeleryOnceRedis(Contestant):
    """celery-once's Redis backend, called the way ``QueueOnce`` calls it
    (``raise_or_lock`` in apply_async, ``clear_lock`` in after_return)."""

    def __init__(self, row: Row, env: Env) -> None:
        super().__init__(row)
        from celery_once.backends import Redis

        self.backend = Redis({"url": env.redis_url, "default_timeout": int(TTL)})
        self.key = f"{env.redis_prefix}once"

    def pair(self) -> None:
        self.backend.raise_or_lock(self.key, timeout=int(TTL))  # raises AlreadyQueued if held
        if self.backend.clear_lock(self.key) != 1:
            raise RuntimeError("celery-once clear_lock removed nothing")


class CelerySingletonRedis(Contestant):
    """celery-singleton's RedisBackend, called the way ``Singleton`` calls it
    (``lock`` in apply_async, ``unlock`` on success/failure)."""

    def __init__(self, row: Row, env: Env) -> None:
        super().__init__(row)
        from celery_singleton.backends.redis import RedisBackend

        self.backend = RedisBackend(env.redis_url)
        self.key = f"{env.redis_prefix}singleton"

    def pair(self) -> None:
        if not self.backend.lock(self.key, uuid.uuid4().hex, expiry=int(TTL)):
            raise RuntimeError("celery-singleton lock not granted")
        self.backend.unlock(self.key)

    def close(self) -> None:
        self.backend.redis.close()


def rows() -> list[Row]:
    """The rows of this section, in table order (also the test's list of expected rows)."""

    def r(id_: str, label: str, ref: str | None) -> Row:
        return Row(id=f"pair.{id_}", section="1. pairs", label=label, ref=ref and f"pair.{ref}")

    return [
        r("pg_floor", "floor: 2x SELECT 1 (PostgreSQL)", None),
        r("minimal", "minimal correct lock by hand (upsert+release), psycopg prepared", "pg_floor"),
        r("raw_sql", "taskguard's own SQL by hand, psycopg prepared", "minimal"),
        r("taskguard", "taskguard acquire+release", "minimal"),
        r("taskguard_unnamed", "taskguard, unnamed statements (as via a pooler)", "taskguard"),
        r("taskguard_pgbouncer_tx", "taskguard via PgBouncer (transaction)", "taskguard"),
        r(
            "taskguard_pgbouncer_prepared",
            "taskguard via PgBouncer (transaction, max_prepared_statements), named statements",
            "taskguard",
        ),
        r("raw_sql_relaxed", "raw SQL, synchronous_commit=off", "pg_floor"),
        r("taskguard_relaxed", "taskguard durable=False", "raw_sql_relaxed"),
        r("pg_advisory", "pg_try_advisory_lock + unlock", "pg_floor"),
        r("maria_floor", "floor: 2x SELECT 1 (MariaDB, mysqlclient)", None),
        r("maria_raw_sql", "raw SQL upsert+release, MariaDB, mysqlclient", "maria_floor"),
        r("maria_taskguard", "taskguard acquire+release, MariaDB", "maria_raw_sql"),
        r("maria_raw_pymysql", "same raw SQL on PyMySQL (driver choice)", "maria_raw_sql"),
        r("redis_floor", "floor: 2x PING (Redis)", None),
        r("celery_once", "celery-once Redis backend", "redis_floor"),
        r("celery_singleton", "celery-singleton Redis backend", "redis_floor"),
    ]


def run(env: Env) -> list[Row]:
    out = rows()
    rounds, per_round, warmup = env.pick((2, 150, 20), (6, 1500, 100))
    with ExitStack() as stack:
        url = stack.enter_context(scratch_db(env, "pairs"))
        bouncer: list[PgBouncer] = []

        def via_pgbouncer(row: Row) -> Contestant:
            # Transaction pooling, pool of 5: how most Django/Celery sites reach PostgreSQL.
            if not bouncer:
                port = make_url(url).port or 5432
                bouncer.append(stack.enter_context(PgBouncer(port, pool_mode="transaction")))
            return TaskGuardPair(row, bouncer[0].via(url), durable=True)

        prepared_bin = os.environ.get(PREPARED_BIN_VAR)

        def via_pgbouncer_prepared(row: Row) -> Contestant:
            # A second PgBouncer, from that binary, tracking each client's named statements.
            port = make_url(url).port or 5432
            pooler = stack.enter_context(
                PgBouncer(
                    port,
                    pool_mode="transaction",
                    settings={"max_prepared_statements": "100"},
                    binary=prepared_bin,
                )
            )
            return TaskGuardPair(row, pooler.via(url), durable=True, **NAMED)

        if not prepared_bin:
            not_run(
                [r for r in out if r.id == "pair.taskguard_pgbouncer_prepared"],
                f"set {PREPARED_BIN_VAR} to a pgbouncer >= 1.21 binary",
            )
        maria = stack.enter_context(maria_scratch_db(env, "pairs"))
        makers: dict[str, Callable[[Row], Contestant]] = {
            "pair.maria_floor": lambda row: MariaSelectOne(row, maria),
            "pair.maria_raw_sql": lambda row: MariaRawSql(row, maria),
            "pair.maria_taskguard": lambda row: TaskGuardPair(row, maria, durable=True),
            "pair.maria_raw_pymysql": lambda row: MariaRawSql(row, maria, "pymysql"),
            "pair.pg_floor": lambda row: PgSelectOne(row, url),
            "pair.minimal": lambda row: MinimalLock(row, url),
            "pair.raw_sql": lambda row: RawSql(row, url, durable=True),
            "pair.taskguard": lambda row: TaskGuardPair(row, url, durable=True),
            "pair.taskguard_unnamed": lambda row: TaskGuardPair(row, url, durable=True, **UNNAMED),
            "pair.taskguard_pgbouncer_tx": via_pgbouncer,
            "pair.taskguard_pgbouncer_prepared": via_pgbouncer_prepared,
            "pair.raw_sql_relaxed": lambda row: RawSql(row, url, durable=False),
            "pair.taskguard_relaxed": lambda row: TaskGuardPair(row, url, durable=False),
            "pair.pg_advisory": lambda row: PgAdvisory(row, url),
            "pair.redis_floor": lambda row: RedisPing(row, env),
            "pair.celery_once": lambda row: CeleryOnceRedis(row, env),
            "pair.celery_singleton": lambda row: CelerySingletonRedis(row, env),
        }
        runnable = [r for r in out if r.status == "ok"]
        measure_rows(runnable, makers, rounds, per_round, warmup, admin_url=url)
    return out


def measure_rows(
    rows: list[Row],
    makers: dict[str, Callable[[Row], Contestant]],
    rounds: int,
    per_round: int,
    warmup: int,
    *,
    admin_url: str,
) -> None:
    """Make each row's contestant (a row that cannot be made is reported, the others
    measured), measure them interleaved, close them."""
    contestants: list[Contestant] = []
    try:
        for row in rows:
            try:
                contestants.append(makers[row.id](row))
            except Exception as exc:
                not_run([row], f"{type(exc).__name__}: {exc}", error=True)
        measure(contestants, rounds, per_round, warmup, admin_url=admin_url)
    finally:
        for c in contestants:
            c.close()


def measure(
    contestants: list[Contestant],
    rounds: int,
    per_round: int,
    warmup: int,
    admin_url: str | None = None,
) -> None:
    """Run every contestant ``rounds`` times ``per_round`` pairs, interleaved (the
    order rotating each round). With ``admin_url`` (any database of the PostgreSQL
    server) the CPU of each named contestant's backends is read around its rounds."""
    samples: dict[str, list[int]] = {c.row.id: [] for c in contestants}
    elapsed: dict[str, int] = dict.fromkeys(samples, 0)
    # This process's CPU time: the client-side cost, which machine load barely moves.
    client: dict[str, float] = dict.fromkeys(samples, 0.0)
    # The CPU of each contestant's PostgreSQL backends (by application_name).
    server: dict[str, float] = dict.fromkeys(samples, 0.0)
    pids: dict[str, list[int]] = {}
    live = list(contestants)
    for c in list(live):
        try:
            for _ in range(warmup):  # fills pools and lets psycopg prepare statements
                c.pair()
        except Exception as exc:
            not_run([c.row], f"{type(exc).__name__}: {exc}", error=True)
            live.remove(c)
    if admin_url is not None:
        with psycopg.connect(libpq_url(admin_url), autocommit=True) as conn:
            for c in live:
                if c.app_name is not None:
                    pids[c.row.id] = cpu.backends(conn, application_name=c.app_name)
    for rnd in range(rounds):
        shift = rnd % max(1, len(live))
        for c in live[shift:] + live[:shift]:
            if c.row.status != "ok":
                continue
            lat = samples[c.row.id]
            gc.collect()
            try:
                mine = pids.get(c.row.id, [])
                server_start = cpu.sum_task_cpu_s(mine)
                start, cpu_start = now_ns(), time.process_time()
                for _ in range(per_round):
                    t0 = now_ns()
                    c.pair()
                    lat.append(now_ns() - t0)
                elapsed[c.row.id] += now_ns() - start
                client[c.row.id] += time.process_time() - cpu_start
                server[c.row.id] += cpu.sum_task_cpu_s(mine) - server_start
            except Exception as exc:
                not_run([c.row], f"{type(exc).__name__}: {exc}", error=True)
    for c in live:
        if c.row.status != "ok":
            continue
        lat = samples[c.row.id]
        c.row.rate = len(lat) / (elapsed[c.row.id] / 1e9)
        c.row.p50_ms, c.row.p99_ms = latency_ms(lat)
        cpu_us = client[c.row.id] / len(lat) * 1e6
        c.row.extra = {"pairs": len(lat), "rounds": rounds, "client_cpu_us_per_pair": cpu_us}
        c.row.note = f"client CPU {cpu_us:,.0f} us/pair"
        if pids.get(c.row.id):
            server_us = server[c.row.id] / len(lat) * 1e6
            c.row.extra["server_cpu_us_per_pair"] = server_us
            c.row.extra["backends"] = len(pids[c.row.id])
            c.row.note += f", PostgreSQL CPU {server_us:,.0f} us/pair"


def profile_taskguard(env: Env, pairs: int, *, durable: bool) -> str:
    """cProfile of taskguard acquire+release pairs (``bench.py --profile``)."""
    import cProfile
    import io
    import pstats

    with scratch_db(env, "profile") as url:
        c = TaskGuardPair(Row(id="profile", section="", label=""), url, durable=durable)
        try:
            for _ in range(50):
                c.pair()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(pairs):
                c.pair()
            prof.disable()
        finally:
            c.close()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    stats.print_stats(25)
    return buf.getvalue()
