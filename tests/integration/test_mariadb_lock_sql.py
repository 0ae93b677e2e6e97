"""The MariaDB lock SQL itself, proven with real processes before anything is built on it.

Statements come straight from :mod:`taskguard.dialects.mariadb` and run on plain
driver connections (no TaskGuard), so a failure here is the SQL's, not the
guard's. Overlaps are judged by the database clock: every grant records its
``acquired_at`` and every release the exact database time it ended the lease.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import signal
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url, text
from sqlalchemy.dialects.mysql import mysqldb

from taskguard.dialects import mariadb as sql
from taskguard.dialects.base import Statement, compile_for
from tests.services import maria_admin

MySQLdb = pytest.importorskip("MySQLdb")

_D = mysqldb.dialect()
ACQUIRE = compile_for(text(sql.ACQUIRE), _D)
ACQUIRE_SLOTS = compile_for(text(sql.ACQUIRE_SLOTS), _D)
# The test's own release: the same WHERE, plus the exact database time it ended the lease.
RELEASE = compile_for(
    text(
        sql.RELEASE.replace(
            "expires_at = UTC_TIMESTAMP(6)", "expires_at = @tg_end := UTC_TIMESTAMP(6)"
        )
    ),
    _D,
)
DEADLOCK, LOCK_WAIT = 1213, 1205


def _connect(db: str) -> Any:
    conn = maria_admin(db)  # the server of TASKGUARD_TEST_MARIADB_URL
    cur = conn.cursor()
    for stmt in sql.SESSION_SETUP:
        cur.execute(stmt)
    return conn


def _run(cur: Any, stmt: Statement, values: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Execute, retrying a statement the server rolled back (deadlock / lock wait)."""
    for attempt in range(20):
        try:
            cur.execute(stmt.sql, stmt.params(values))
            return list(cur.fetchall()) if cur.description else []
        except MySQLdb.OperationalError as exc:
            if exc.args[0] not in (DEADLOCK, LOCK_WAIT) or attempt == 19:
                raise
            time.sleep(0.001 * (attempt + 1))
    raise AssertionError("unreachable")


def _acquire(cur: Any, key: str, ttl: float, owner: str) -> tuple[Any, ...] | None:
    rows = _run(
        cur,
        ACQUIRE,
        {
            "key": key,
            "slot": 0,
            "owner": owner,
            "ttl": round(ttl * 1e6),
            "task_name": None,
            "task_id": None,
            "hostname": "race",
            "pid": os.getpid(),
            "phase": None,
            "n": 1,
        },
    )
    assert len(rows) == 1
    # (owner, token, acquired_at, expires_at); the rest of the row follows.
    return tuple(rows[0][:4]) if rows[0][0] == owner else None


@pytest.fixture
def maria_db(maria_url: str) -> str:
    """The test's own migrated MariaDB database (its name: these tests use the driver)."""
    return str(make_url(maria_url).database)


def _race_one(db: str, barrier: Any, keys: list[str], ttl: float, out: Any) -> None:
    cur = _connect(db).cursor()
    wins = []
    for key in keys:
        barrier.wait(timeout=60)
        owner = uuid.uuid4().hex
        got = _acquire(cur, key, ttl, owner)
        if got is not None:
            wins.append((key, int(got[1])))
    out.put(wins)


def _race(db: str, keys: list[str], procs: int = 16) -> list[tuple[str, int]]:
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_race_one, args=(db, barrier, keys, 30.0, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    wins = [w for _ in ps for w in out.get(timeout=120)]
    for p in ps:
        p.join(timeout=30)
        assert p.exitcode == 0
    return wins


def test_sixteen_processes_one_new_key_exactly_one_winner(maria_db: str) -> None:
    keys = [f"new:{i}" for i in range(10)]
    wins = _race(maria_db, keys)
    assert sorted(k for k, _ in wins) == keys


def test_sixteen_processes_one_expired_key_exactly_one_winner(maria_db: str) -> None:
    cur = _connect(maria_db).cursor()
    keys = [f"stale:{i}" for i in range(10)]
    old = {}
    for key in keys:
        got = _acquire(cur, key, 0.001, uuid.uuid4().hex)
        assert got is not None
        old[key] = int(got[1])
    time.sleep(0.05)
    wins = _race(maria_db, keys)
    assert sorted(k for k, _ in wins) == keys
    assert all(token > old[key] for key, token in wins)


def test_limit_three_sixteen_processes_at_most_three(maria_db: str) -> None:
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(16), ctx.Queue()

    def contend() -> None:
        cur = _connect(maria_db).cursor()
        barrier.wait(timeout=60)
        owner = uuid.uuid4().hex
        values = {"key": "lim", "n": 3, "owner": owner, "ttl": 30_000_000, "task_name": None,
                  "task_id": None, "hostname": "race", "pid": os.getpid(), "phase": "run"}  # fmt: skip
        got = None
        for _ in range(2):  # a lost race for a new slot: one more try, as the guard does
            rows = _run(cur, ACQUIRE_SLOTS, values)
            if not rows:
                break
            if rows[0][1] == owner:
                got = (int(rows[0][0]), int(rows[0][2]))
                break
        out.put(got)

    ps = [ctx.Process(target=contend) for _ in range(16)]
    for p in ps:
        p.start()
    got = [out.get(timeout=60) for _ in ps]
    for p in ps:
        p.join(timeout=30)
    won = [g for g in got if g is not None]
    assert 1 <= len(won) <= 3
    assert len({slot for slot, _ in won}) == len(won)


KEYS = ("k0", "k1", "k2")
TTL = 1.0
_FMT = "%Y-%m-%d %H:%M:%S.%f"


def _holder(db: str, log: str, state: Any, turn: Any, idx: int, stop_at: float) -> None:
    """Contend for random keys; log each grant and release by the database clock.

    ``state[idx]`` is 1 while this process holds a grant the parent may kill it
    with; it goes back to 0 under ``turn``, the lock the parent holds while it
    decides and kills, so a kill never lands after the release has committed (its
    log line would then be missing and the grant read as held until expiry)."""
    conn = _connect(db)
    cur = conn.cursor()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    rnd = random.Random(os.getpid())
    while time.time() < stop_at:
        key = rnd.choice(KEYS)
        owner = uuid.uuid4().hex
        got = _acquire(cur, key, TTL, owner)
        if got is None:
            time.sleep(rnd.uniform(0.001, 0.01))
            continue
        _, token, acquired_at, expires_at = got
        # One write(2) per line: it reaches the file even if we are SIGKILLed right after.
        os.write(fd, f"G {key} {owner} {token} {acquired_at:{_FMT}} {expires_at:{_FMT}}\n".encode())
        state[idx] = 1  # holding: the parent may kill us now
        time.sleep(rnd.uniform(0.005, 0.05))
        with turn:
            state[idx] = 0
        _run(cur, RELEASE, {"key": key, "slot": 0, "owner": owner})
        ok = cur.rowcount == 1
        cur.execute("SELECT CAST(@tg_end AS DATETIME(6))")
        end = cur.fetchone()[0] if ok else None
        os.write(fd, f"R {owner} {end if end is None else f'{end:{_FMT}}'} {int(ok)}\n".encode())
    os.close(fd)


def test_sigkilled_holders_no_overlap_tokens_increase_key_back(
    maria_db: str, tmp_path: Path
) -> None:
    ctx = mp.get_context("fork")
    procs, seconds = 8, float(os.environ.get("TG_RACE_SECONDS", "8"))
    state = ctx.Array("i", procs, lock=False)
    turns = [ctx.Lock() for _ in range(procs)]
    log = str(tmp_path / "grants.log")
    stop_at = time.time() + seconds
    workers = {}

    def spawn(i: int) -> None:
        state[i] = 0
        p = ctx.Process(target=_holder, args=(maria_db, log, state, turns[i], i, stop_at))
        p.start()
        workers[i] = p

    for i in range(procs):
        spawn(i)
    kills = 0
    while time.time() < stop_at - 0.5:
        time.sleep(0.3)
        holding = [i for i in range(procs) if state[i] == 1]
        if holding:
            i = random.choice(holding)
            with turns[i]:  # the child cannot start its release meanwhile
                if state[i] != 1:
                    continue
                os.kill(workers[i].pid, signal.SIGKILL)
                workers[i].join()
            kills += 1
            spawn(i)
    for p in workers.values():
        p.join(timeout=30)
        assert p.exitcode == 0

    grants: dict[str, list[dict[str, Any]]] = {k: [] for k in KEYS}
    by_owner: dict[str, dict[str, Any]] = {}
    for line in Path(log).read_text().splitlines():
        parts = line.split(" ")
        if parts[0] == "G":
            g = {
                "key": parts[1],
                "owner": parts[2],
                "token": int(parts[3]),
                "start": datetime.strptime(f"{parts[4]} {parts[5]}", _FMT),
                "expires": datetime.strptime(f"{parts[6]} {parts[7]}", _FMT),
                "end": None,
            }
            grants[g["key"]].append(g)
            by_owner[g["owner"]] = g
        else:
            g = by_owner[parts[1]]
            if parts[-1] == "1":
                g["end"] = datetime.strptime(f"{parts[2]} {parts[3]}", _FMT)
    overlaps, back_late, total, killed = 0, [], 0, 0
    for key, gs in grants.items():
        gs.sort(key=lambda g: g["start"])
        total += len(gs)
        for prev, nxt in itertools.pairwise(gs):
            end = prev["end"] or prev["expires"]
            if nxt["start"] < end:
                overlaps += 1
            assert nxt["token"] > prev["token"], (key, prev, nxt)
            if prev["end"] is None:
                killed += 1
                if nxt["start"] - prev["start"] > timedelta(seconds=TTL + 1):
                    back_late.append((key, prev, nxt))
    print(f"grants={total} kills={kills} unreleased-then-retaken={killed}")
    assert kills >= 5 and total > 50
    assert overlaps == 0
    assert back_late == []


def test_takeover_of_a_used_up_reservation_moves_every_column(maria_db: str) -> None:
    """The waiter that was reserved got the row (next_owner = owner) and let it
    expire: a newcomer takes it over. Assignments run left to right, so a condition
    re-evaluated after ``owner`` changed would see next_owner != owner and stop
    half way (new owner, old token and expiry)."""
    cur = _connect(maria_db).cursor()
    first = _acquire(cur, "resv", 0.001, "w" * 32)
    assert first is not None
    cur.execute(
        "UPDATE task_locks SET next_owner = owner, next_since = UTC_TIMESTAMP(6),"
        " next_until = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE `key` = 'resv'"
    )
    time.sleep(0.01)
    got = _acquire(cur, "resv", 30, "n" * 32)
    assert got is not None
    _, token, acquired_at, expires_at = got
    assert token > first[1]
    assert acquired_at > first[2]
    assert expires_at - acquired_at == timedelta(seconds=30)


def test_a_reservation_for_another_waiter_is_respected(maria_db: str) -> None:
    cur = _connect(maria_db).cursor()
    assert _acquire(cur, "resv2", 0.001, "h" * 32) is not None
    cur.execute(
        "UPDATE task_locks SET next_owner = %s, next_since = UTC_TIMESTAMP(6),"
        " next_until = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE `key` = 'resv2'",
        ("w" * 32,),
    )
    time.sleep(0.01)
    assert _acquire(cur, "resv2", 30, "n" * 32) is None  # inside the grace: only the waiter
    assert _acquire(cur, "resv2", 30, "w" * 32) is not None


def test_fence_holds_off_a_takeover_until_the_business_transaction_ends(maria_db: str) -> None:
    fence = compile_for(text(sql.FENCE), _D)
    cur = _connect(maria_db).cursor()
    lease = _acquire(cur, "fenced", 0.3, "f" * 32)
    assert lease is not None
    business = MySQLdb.connect(host="127.0.0.1", user="root", database=maria_db, autocommit=False)
    bcur = business.cursor()  # the application's session: default REPEATABLE READ
    bcur.execute(
        fence.sql, fence.params({"lease_key": "fenced", "lease_slot": 0, "lease_owner": "f" * 32})
    )
    assert bcur.fetchall() == ((lease[1],),)
    time.sleep(0.4)  # the lease expires while the business transaction is still open
    done: list[float] = []

    def take_over() -> None:
        other = _connect(maria_db).cursor()
        started = time.monotonic()
        assert _acquire(other, "fenced", 30, "t" * 32) is not None
        done.append(time.monotonic() - started)

    import threading

    th = threading.Thread(target=take_over)
    th.start()
    time.sleep(0.5)
    assert done == []  # waiting for the fence's shared lock
    business.commit()
    th.join(timeout=10)
    assert done and done[0] >= 0.4  # it waited for the commit, not for its own turn


def test_reap_walks_in_batches_and_records_history(maria_db: str) -> None:
    reap = compile_for(text(sql.REAP), _D)
    reaped_events = compile_for(text(sql.REAPED_EVENTS), _D)
    cur = _connect(maria_db).cursor()
    cur.execute(
        "INSERT INTO task_locks (`key`, slot, owner, token, acquired_at, expires_at)"
        " SELECT CONCAT('k', LPAD(seq, 4, '0')), 0, 'x', seq,"
        " UTC_TIMESTAMP(6) - INTERVAL 2 HOUR,"
        " IF(seq MOD 3 = 0, UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR)"
        " FROM seq_1_to_100"
    )
    after: dict[str, Any] = {"after_key": "", "after_slot": -1}
    removed, batches = 0, 0
    while True:
        rows = _run(cur, reap, {**after, "grace": -60_000_000, "batch_size": 10})
        batches += 1
        removed += len(rows)
        if rows:
            import json

            _run(cur, reaped_events, {"rows": json.dumps([list(r) for r in rows])})
            after = {"after_key": rows[-1][0], "after_slot": rows[-1][1]}
        if len(rows) < 10:
            break
    assert removed == 67 and batches == 7
    cur.execute("SELECT COUNT(*), MIN(event), MAX(event) FROM task_lock_events")
    assert cur.fetchone() == (67, "reaped", "reaped")
    cur.execute("SELECT COUNT(*) FROM task_locks")
    assert cur.fetchone() == (33,)


def test_force_release_reports_and_ends_every_live_slot(maria_db: str) -> None:
    force = compile_for(text(sql.FORCE_RELEASE), _D)
    cur = _connect(maria_db).cursor()
    assert _acquire(cur, "forced", 30, "a" * 32) is not None
    got = _run(cur, force, {"key": "forced"})
    assert [(r[0], r[1]) for r in got] == [(0, "a" * 32)]
    assert _run(cur, force, {"key": "forced"}) == []
    cur.execute("SELECT owner, expires_at <= UTC_TIMESTAMP(6) FROM task_locks")
    assert cur.fetchall() == (("a" * 32, 1),)  # ended, not deleted
    assert _acquire(cur, "forced", 30, "b" * 32) is not None


def test_a_refused_acquire_returns_the_holders_row(maria_db: str) -> None:
    """The upsert's RETURNING shows the row whoever holds it: refused, that is the
    holder (what TaskGuard logs and returns, with no read of its own)."""
    cur = _connect(maria_db).cursor()
    assert _acquire(cur, "held", 30, "a" * 32) is not None
    rows = _run(
        cur,
        ACQUIRE,
        {
            "key": "held", "slot": 0, "owner": "b" * 32, "ttl": 30_000_000,
            "task_name": "dup", "task_id": "t2", "hostname": "h2", "pid": 2, "phase": "queue",
            "n": 1,
        },
    )  # fmt: skip
    (row,) = rows
    owner, _, _, expires_at, key, slot, task_name, task_id, hostname, _, phase, slots, read_at = row
    assert (owner, key, slot, task_name, task_id) == ("a" * 32, "held", 0, None, None)
    assert (phase, slots) == (None, 1)  # the holder's, not the refused caller's
    assert hostname == "race" and expires_at > read_at
