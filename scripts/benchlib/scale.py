"""Section 3: acquire latency as the table grows, the reaper, and bloat under churn.

Tables are filled server-side (INSERT ... SELECT generate_series) with leases that
ended an hour ago, like rows of finished tasks waiting for the reaper. The three
sizes live in three scratch databases at once so their acquire latencies can be
measured interleaved, round by round, under the same machine load.

The reaper also runs on MariaDB, with acquires of 50 keys that sort among the rows
it deletes; the server's row-lock waits during the reap say whether it ever blocked
them (server-wide: another client of the server can add some).
"""

from __future__ import annotations

import contextlib
import glob
import multiprocessing as mp
import os
import random
import re
import shutil
import subprocess
import time
from typing import Any

import psycopg
from sqlalchemy import create_engine, text

from benchlib.common import (
    Env,
    Row,
    latency_ms,
    libpq_url,
    maria_admin,
    maria_scratch_db,
    now_ns,
    scratch_db,
    stop_children,
)
from taskguard import TaskGuard
from taskguard.dialects import Statement, lock_sql_for

TTL = 60.0
GRACE = 300.0
BLOAT_KEYS = 1000


def _sizes(env: Env) -> dict[str, int]:
    return env.pick(
        {"small": 1_000, "medium": 10_000, "large": 50_000},
        {"small": 1_000, "medium": 100_000, "large": 1_000_000},
    )


def rows() -> list[Row]:
    def r(id_: str, label: str, **kw: Any) -> Row:
        return Row(id=f"scale.{id_}", section="3. scale", label=label, **kw)

    out: list[Row] = []
    for mode in ("durable", "relaxed"):
        for size in ("small", "medium", "large"):
            ref = None if size == "small" else f"scale.acquire_small_{mode}"
            out.append(
                r(
                    f"acquire_{size}_{mode}",
                    f"acquire, {size} table, {mode}",
                    unit="acquires/s",
                    ref=ref,
                    ratio_kind="p50",
                )
            )
    for suffix, probed, server in (
        ("", "1 key", ""),
        ("_mariadb", "50 keys among the reaped rows", ", MariaDB"),
    ):
        out += [
            r(
                f"acquire_idle{suffix}",
                f"acquire, {probed}, before reaping{server}",
                unit="acquires/s",
            ),
            r(f"reaper{suffix}", f"reaper on the large table{server}", unit="rows/s"),
            r(
                f"acquire_during_reap{suffix}",
                f"acquire, {probed}, while the reaper runs{server}",
                unit="acquires/s",
                ref=f"scale.acquire_idle{suffix}",
                ratio_kind="p99",
            ),
        ]
    out.append(r("bloat", "acquire/release churn on 1,000 keys (pgbench)", unit="cycles/s"))
    return out


def _fill(url: str, count: int) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO task_locks (key, slot, owner, token, acquired_at, expires_at, "
            "task_name, task_id, hostname, pid) "
            "SELECT 'fill:' || lpad(g::text, 8, '0'), 0, md5(g::text), "
            "nextval('task_locks_token_seq'), now() - interval '2 hours', "
            "now() - interval '1 hour', 'bench.fill', md5(g::text), 'bench', 0 "
            "FROM generate_series(0, %s) AS g",
            (count - 1,),
        )
        conn.execute("VACUUM ANALYZE task_locks")


def _measure_acquire(
    env: Env, out: dict[str, Row], urls: dict[str, str], sizes: dict[str, int]
) -> None:
    rounds, per_round = env.pick((2, 60), (5, 300))
    guards = {
        (size, mode): TaskGuard(urls[size], durable=(mode == "durable"))
        for size in urls
        for mode in ("durable", "relaxed")
    }
    samples: dict[tuple[str, str], list[int]] = {k: [] for k in guards}
    rnd = random.Random(6)
    try:
        for guard in guards.values():  # connect and prepare before timing
            for i in range(10):
                lease = guard.acquire(f"fill:{i:08d}", TTL)
                assert lease is not None and guard.release(lease)
        order = list(guards)
        for n in range(rounds):
            rnd.shuffle(order)
            for key in order:
                size, _ = key
                guard, lat = guards[key], samples[key]
                for _ in range(per_round):
                    k = f"fill:{rnd.randrange(sizes[size]):08d}"
                    t0 = now_ns()
                    lease = guard.acquire(k, TTL)
                    lat.append(now_ns() - t0)
                    if lease is None or not guard.release(lease):
                        raise RuntimeError(f"acquire/release of {k} failed in round {n}")
    finally:
        for guard in guards.values():
            guard.dispose()
    for (size, mode), lat in samples.items():
        row = out[f"scale.acquire_{size}_{mode}"]
        row.rate = len(lat) / (sum(lat) / 1e9)
        row.p50_ms, row.p99_ms = latency_ms(lat)
        row.label = f"acquire, {sizes[size]:,} rows, {mode}"
        row.extra = {"rows": sizes[size], "samples": len(lat)}
        row.note = "random existing key (takeover of an expired row)"


def _fill_mariadb(url: str, count: int) -> None:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(
                text(
                    "INSERT INTO task_locks (`key`, slot, owner, token, acquired_at, expires_at) "
                    "SELECT CONCAT('fill:', LPAD(seq, 8, '0')), 0, MD5(seq), seq, "
                    "UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR "
                    f"FROM seq_0_to_{count - 1}"
                )
            )
    finally:
        engine.dispose()


def _row_lock_waits(env: Env) -> int:
    conn = maria_admin(env)
    try:
        cur = conn.cursor()
        cur.execute("SHOW GLOBAL STATUS LIKE 'Innodb_row_lock_waits'")
        return int(cur.fetchone()[1])
    finally:
        conn.close()


def _prober(queue: Any, url: str, stop: Any, max_samples: int, keys: list[str]) -> None:
    """Acquire+release ``keys`` in turn; report (when, latency) per acquire."""
    guard = TaskGuard(url)
    points: list[tuple[float, int]] = []
    try:
        while not stop.is_set() and len(points) < max_samples:
            t0 = now_ns()
            lease = guard.acquire(keys[len(points) % len(keys)], TTL)
            points.append((time.monotonic(), now_ns() - t0))
            if lease is not None:
                guard.release(lease)
    finally:
        guard.dispose()
        queue.put(points)


def _reap(
    env: Env, out: dict[str, Row], url: str, size: int, keys: list[str], suffix: str = ""
) -> None:
    ctx = mp.get_context("fork")
    queue: Any = ctx.Queue()
    stop = ctx.Event()
    prober = ctx.Process(target=_prober, args=(queue, url, stop, 2_000_000, keys), daemon=True)
    guard = TaskGuard(url)
    try:
        prober.start()
        time.sleep(env.pick(1.0, 3.0))  # the idle baseline
        t_start = time.monotonic()
        removed = guard.reap(grace=GRACE, batch_size=5000)
        t_end = time.monotonic()
        time.sleep(0.2)
        stop.set()
        points = queue.get(timeout=60)
    finally:
        stop.set()
        stop_children([prober])
        guard.dispose()
    idle = [lat for t, lat in points if t < t_start]
    during = [lat for t, lat in points if t_start <= t <= t_end]
    for row_id, lat in (("acquire_idle", idle), ("acquire_during_reap", during)):
        row = out[f"scale.{row_id}{suffix}"]
        if len(lat) < 5:
            row.status = f"not run: only {len(lat)} samples (reap too short to probe)"
            continue
        row.rate = len(lat) / (sum(lat) / 1e9)
        row.p50_ms, row.p99_ms = latency_ms(lat)
        row.extra = {"samples": len(lat)}
    row = out[f"scale.reaper{suffix}"]
    row.rate = removed / (t_end - t_start)
    row.label = f"reaper, {size:,} expired rows" + (", MariaDB" if suffix else "")
    row.extra = {"removed": int(removed), "batches": removed.batches, "seconds": t_end - t_start}
    row.note = f"removed {int(removed):,} rows in {removed.batches} batches of 5,000, {t_end - t_start:.1f} s"


def _pgbench() -> str | None:
    found = shutil.which("pgbench") or sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"))
    if isinstance(found, list):
        return found[-1] if found else None
    return found


def _pgbench_script(url: str) -> str:
    """taskguard's own acquire and release statements with pgbench variables for values."""
    engine = create_engine(url)
    sql = lock_sql_for(engine.dialect)
    engine.dispose()
    values = {
        "key": "('bloat:' || :k)",
        "slot": "0",
        "n": "1",
        "phase": "'run'",
        "owner": "('o' || :o || '-' || :client_id)",
        "ttl": f"{TTL}",
        "task_name": "'bench.task'",
        "task_id": "('t' || :o)",
        "hostname": "'bench'",
        "pid": "(:client_id)",
    }

    def sub(stmt: Statement) -> str:
        # The statements take their parameters by position (%s), in this order.
        names = iter(stmt.positional_names or ())
        return re.sub(r"%s", lambda _m: values[next(names)], stmt.sql).replace("%%", "%")

    return (
        f"\\set k random(1, {BLOAT_KEYS})\n\\set o random(1, 1000000000)\n"
        f"{sub(sql.acquire)};\n{sub(sql.release)};\n"
    )


def _table_stats(url: str) -> dict[str, int]:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_table_size('task_locks'), pg_indexes_size('task_locks'), "
            "n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd "
            "FROM pg_stat_user_tables WHERE relname = 'task_locks'"
        ).fetchone()
    assert row is not None
    names = ("table_bytes", "index_bytes", "live_tuples", "dead_tuples", "updates", "hot_updates")
    return dict(zip(names, (int(v or 0) for v in row), strict=True))


def _bloat(env: Env, row: Row) -> None:
    pgbench = _pgbench()
    if pgbench is None:
        row.status = "not run: pgbench not found (PostgreSQL client tools)"
        return
    cycles, chunks, clients = env.pick((20_000, 2, 4), (1_000_000, 4, 4))
    per_client = cycles // (chunks * clients)
    with scratch_db(env, "bloat") as url:
        script = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tgbench_{env.run_id}.sql")
        with open(script, "w") as fh:
            fh.write(_pgbench_script(url))
        cmd = [
            pgbench,
            "-n",
            "-M",
            "prepared",
            "-c",
            str(clients),
            "-j",
            "2",
            "-t",
            str(per_client),
            "-f",
            script,
            libpq_url(url),
        ]
        # Relaxed commits only to get a million cycles through quickly: bloat does not
        # depend on when WAL reaches the disk.
        penv = {**os.environ, "PGOPTIONS": "-c synchronous_commit=off"}
        samples = []
        elapsed = 0.0
        try:
            for _ in range(chunks):
                t0 = time.monotonic()
                subprocess.run(
                    cmd, env=penv, check=True, capture_output=True, text=True, timeout=600
                )
                elapsed += time.monotonic() - t0
                samples.append(_table_stats(url))
            # What autovacuum would do (it may be off on the server, see the run's facts):
            # one VACUUM, then one more chunk to see whether the freed space is reused.
            with psycopg.connect(libpq_url(url), autocommit=True) as conn:
                conn.execute("VACUUM task_locks")
            subprocess.run(cmd, env=penv, check=True, capture_output=True, text=True, timeout=600)
            after_vacuum = _table_stats(url)
        finally:
            with contextlib.suppress(OSError):
                os.remove(script)
    done = per_client * clients * chunks
    first, last = samples[0], samples[-1]
    growth = (last["table_bytes"] + last["index_bytes"]) / max(
        1, first["table_bytes"] + first["index_bytes"]
    )
    row.rate = done / elapsed
    row.label = (
        f"{done:,} acquire/release cycles on {BLOAT_KEYS:,} keys (pgbench, {clients} clients)"
    )
    row.extra = {
        "cycles": done,
        "chunks": samples,
        "growth_last_vs_first_chunk": growth,
        "after_vacuum_and_one_more_chunk": after_vacuum,
    }
    row.note = (
        f"after: table {last['table_bytes'] // 1024:,} kB + index {last['index_bytes'] // 1024:,} kB "
        f"for {BLOAT_KEYS:,} keys; after first {100 // chunks}%: "
        f"{first['table_bytes'] // 1024:,} + {first['index_bytes'] // 1024:,} kB (x{growth:.2f}); "
        f"HOT {last['hot_updates'] / max(1, last['updates']):.1%} of updates; "
        f"then VACUUM + {done // chunks:,} more cycles: "
        f"{after_vacuum['table_bytes'] // 1024:,} + {after_vacuum['index_bytes'] // 1024:,} kB"
    )


def run(env: Env) -> list[Row]:
    out = rows()
    by_id = {r.id: r for r in out}
    sizes = _sizes(env)
    with contextlib.ExitStack() as stack:
        urls = {size: stack.enter_context(scratch_db(env, f"scale_{size}")) for size in sizes}
        for size, count in sizes.items():
            _fill(urls[size], count)
        _measure_acquire(env, by_id, urls, sizes)
        _reap(env, by_id, urls["large"], sizes["large"], ["probe:reaper"])
    _bloat(env, by_id["scale.bloat"])
    with maria_scratch_db(env, "scale") as url:
        size = sizes["large"]
        _fill_mariadb(url, size)
        waits = _row_lock_waits(env)
        live = [f"fill:{i * (size // 50):08d}-live" for i in range(50)]
        _reap(env, by_id, url, size, live, suffix="_mariadb")
        waits = _row_lock_waits(env) - waits
        by_id["scale.reaper_mariadb"].extra["row_lock_waits"] = waits
        by_id["scale.reaper_mariadb"].note += f"; {waits} row-lock waits on the server meanwhile"
    return out
