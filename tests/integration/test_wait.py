"""Waiting for a held key (``acquire(..., wait=T)``) with real processes: woken by
LISTEN/NOTIFY on PostgreSQL, polling on SQLite, fair to the longest waiter."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from taskguard import TaskGuard
from taskguard.models import TaskLock
from taskguard.waiting import RENEW_EVERY, RESERVATION

pytestmark = pytest.mark.slow


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _counting(guard: TaskGuard) -> list[str]:
    """Record every statement the guard sends (to prove the waiter does not poll)."""
    sent: list[str] = []
    run = guard._store._db.run

    def counted(stmt: Any, values: dict[str, Any], deadline: float | None = None) -> Any:
        sent.append(stmt.sql.split()[0])
        return run(stmt, values, deadline)

    guard._store._db.run = guard._store.run = counted  # type: ignore[method-assign]
    return sent


def _holder(url: str, key: str, hold: float, ready: Any, out: Any) -> None:
    guard = TaskGuard(url)
    lease = guard.acquire(key, 60)
    assert lease is not None
    ready.set()
    time.sleep(hold)
    assert guard.release(lease)
    out.put(("released", time.time()))
    guard.dispose()


def _waiter(url: str, key: str, timeout: float, out: Any, in_line: Any = None) -> None:
    guard = TaskGuard(url)
    if in_line is not None:
        _telling_when_in_line(guard, in_line)
    sent = _counting(guard)
    lease = guard.acquire(key, 60, wait=timeout)
    out.put(
        ("granted" if lease else "timeout", time.time(), list(sent))
    )  # copy: put() pickles later
    if lease:
        guard.release(lease)
    guard.dispose()


def test_waiter_is_woken_within_100ms_of_release_without_polling(pg_url: str) -> None:
    ctx = mp.get_context("fork")
    ready, out = ctx.Event(), ctx.Queue()
    holder = ctx.Process(target=_holder, args=(pg_url, "k", 1.5, ready, out))
    holder.start()
    assert ready.wait(30)
    waiter = ctx.Process(target=_waiter, args=(pg_url, "k", 20.0, out))
    waiter.start()
    results = {r[0]: r for r in (out.get(timeout=60), out.get(timeout=60))}
    for p in (holder, waiter):
        p.join(timeout=30)
        assert p.exitcode == 0
    assert "granted" in results, results
    latency = results["granted"][1] - results["released"][1]
    assert latency < 0.1, f"woken {latency:.3f}s after the release"
    # try (the lean acquire, then the full one, which also reads the holder for the
    # log), announcements (the first, then one renewal of its place in line per
    # RENEW_EVERY), then one try after the NOTIFY (the full acquire: the key is known
    # contended); a poller backing off from 10 ms would have sent dozens in 1.5 s.
    sent = results["granted"][2]
    assert sent[:2] == ["INSERT", "WITH"] and sent[-1] == "WITH", sent
    assert set(sent[2:-1]) == {"UPDATE"}, sent
    assert len(sent) - 3 <= 1.5 / RENEW_EVERY + 2, sent


def test_a_waiter_whose_listener_breaks_goes_on_polling(pg_url: str) -> None:
    """The release listener's connection is terminated while a waiter waits: the
    waiter polls (it used to try only every RECHECK = 5 s), so a release 1 s later
    hands it the key within about a poll interval."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    guard = TaskGuard(pg_url)
    try:
        lease = guard.acquire("nolisten", 60)
        assert lease is not None
        waiter = ctx.Process(target=_waiter, args=(pg_url, "nolisten", 30.0, out))
        waiter.start()
        database = make_url(pg_url).database
        with psycopg.connect(_libpq(pg_url), autocommit=True) as admin:
            deadline = time.monotonic() + 20
            killed = 0
            while not killed and time.monotonic() < deadline:
                time.sleep(0.05)
                killed = len(
                    admin.execute(
                        # The listener's last statement is its pooler check, after LISTEN.
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = %s AND query = 'SELECT pg_backend_pid()'",
                        (database,),
                    ).fetchall()
                )
        assert killed, "the waiter never listened"
        time.sleep(1.0)
        released_at = time.time()
        assert guard.release(lease)
        kind, granted_at, _ = out.get(timeout=40)
        waiter.join(timeout=30)
        assert kind == "granted"
        # Well under RECHECK (5 s), with room for a loaded machine (2 s was too tight).
        assert granted_at - released_at < 4.0, f"granted {granted_at - released_at:.2f}s after"
    finally:
        guard.dispose()


def test_wait_times_out_and_logs_the_holder(
    guard: TaskGuard, caplog: pytest.LogCaptureFixture
) -> None:
    lease = guard.acquire("k", 30, task_name="long_job")
    assert lease is not None
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="taskguard"):
        assert guard.acquire("k", 30, wait=0.4) is None
    assert 0.4 <= time.monotonic() - started < 3
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "waiting up to 0.4s" in text and "gave up" in text and "long_job" in text
    assert guard.get("k").owner == lease.owner  # type: ignore[union-attr]
    assert guard.release(lease)


def _crash(url: str, key: str) -> None:
    TaskGuard(url).acquire(key, 0.5)
    os._exit(0)


def test_waiter_takes_over_when_a_crashed_holder_expires(db_url: str) -> None:
    child = mp.get_context("fork").Process(target=_crash, args=(db_url, "k"))
    child.start()
    child.join(timeout=30)
    guard = TaskGuard(db_url)
    try:
        started = time.monotonic()
        lease = guard.acquire("k", 30, wait=30)
        assert lease is not None
        # Woken at the 0.5 s expiry, not by a re-check (5 s) or the timeout; the rest is
        # room for a loaded machine.
        assert time.monotonic() - started < 4.0
    finally:
        guard.dispose()


def test_a_waiter_is_counted_while_it_waits(db_url: str) -> None:
    """``waited_for()`` (the operators' page's "keys with waiters"): a key a process
    waits for counts while that wait lasts, on the database clock; a held key nobody
    waits for does not."""
    guard = TaskGuard(db_url)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    try:
        held, other = guard.acquire("w:1", 60), guard.acquire("w:2", 60)
        assert held is not None and other is not None
        assert guard.waited_for() == 0
        waiter = ctx.Process(target=_waiter, args=(db_url, "w:1", 4.0, out))
        waiter.start()
        deadline = time.monotonic() + 30
        while guard.waited_for() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard.waited_for() == 1
        assert out.get(timeout=60)[0] == "timeout"
        waiter.join(timeout=30)
        deadline = time.monotonic() + 30  # its announcement runs out with its wait
        while guard.waited_for() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert guard.waited_for() == 0
    finally:
        guard.dispose()


def test_wait_for_a_slot(db_url: str) -> None:
    ctx = mp.get_context("fork")
    ready, out = ctx.Event(), ctx.Queue()
    guard = TaskGuard(db_url)
    try:
        first = guard.acquire("pool", 60, limit=2)
        assert first is not None
        holder = ctx.Process(target=_holder_slot, args=(db_url, ready, out))
        holder.start()
        assert ready.wait(30)
        lease = guard.acquire("pool", 60, limit=2, wait=10)
        assert lease is not None and lease.slot != first.slot
        assert out.get(timeout=30)[0] == "released"
        holder.join(timeout=30)
        assert guard.acquire("pool", 60, limit=2) is None
    finally:
        guard.dispose()


def _holder_slot(url: str, ready: Any, out: Any) -> None:
    guard = TaskGuard(url)
    lease = guard.acquire("pool", 60, limit=2)
    assert lease is not None
    ready.set()
    time.sleep(0.3)
    guard.release(lease)
    out.put(("released", time.time()))
    guard.dispose()


def _telling_when_in_line(guard: TaskGuard, in_line: Any) -> None:
    """Set ``in_line`` once ``guard``'s waiter has announced itself (is in line)."""
    announce = guard._store.waiters.announce

    def announced(*args: Any, **kwargs: Any) -> Any:
        found = announce(*args, **kwargs)
        in_line.set()
        return found

    guard._store.waiters.announce = announced  # type: ignore[method-assign]


def _queued(url: str, name: str, out: Any, in_line: Any) -> None:
    guard = TaskGuard(url)
    _telling_when_in_line(guard, in_line)
    lease = guard.acquire("fair", 30, wait=30, task_name=name)
    assert lease is not None, name
    out.put((name, lease.token))
    time.sleep(0.2)
    guard.release(lease)
    guard.dispose()


def _newcomers(url: str, stop: Any, out: Any) -> None:
    """A steady stream of fresh acquirers that never wait, trying every few ms."""
    guard = TaskGuard(url)
    wins = 0
    while not stop.is_set():
        lease = guard.acquire("fair", 30, task_name="newcomer")
        if lease is not None:
            wins += 1
            time.sleep(0.2)
            guard.release(lease)
        time.sleep(0.003)
    out.put(("newcomers", wins))
    guard.dispose()


def test_the_longest_waiter_goes_first_and_nobody_starves(db_url: str) -> None:
    ctx = mp.get_context("fork")
    out, stop = ctx.Queue(), ctx.Event()
    guard = TaskGuard(db_url)
    try:
        first = guard.acquire("fair", 30, task_name="first")
        assert first is not None
        waiters = []
        for i in range(3):
            # Each waiter starts only once the one before is in line (sleeps alone
            # misorder them on a loaded machine).
            in_line = ctx.Event()
            p = ctx.Process(target=_queued, args=(db_url, f"w{i}", out, in_line))
            p.start()
            waiters.append(p)
            assert in_line.wait(30), f"w{i} never announced itself"
        stream = ctx.Process(target=_newcomers, args=(db_url, stop, out))
        stream.start()
        time.sleep(0.2)
        assert guard.release(first)
        order = [out.get(timeout=30)[0] for _ in waiters]
        stop.set()
        assert out.get(timeout=30)[0] == "newcomers"
        for p in (*waiters, stream):
            p.join(timeout=30)
            assert p.exitcode == 0
        # The release went to the oldest waiter, not to the newcomers hammering
        # the key, and every waiter got its turn despite them.
        assert order[0] == "w0"
        assert sorted(order) == ["w0", "w1", "w2"]
    finally:
        guard.dispose()


def test_no_wait_is_the_default_and_zero_means_no_wait(guard: TaskGuard) -> None:
    lease = guard.acquire("k", 30)
    assert lease is not None
    started = time.monotonic()
    assert guard.acquire("k", 30) is None
    assert guard.acquire("k", 30, wait=0) is None
    assert time.monotonic() - started < 1


def test_no_wait_while_the_unless_key_is_held(guard: TaskGuard) -> None:
    """``unless=`` (a job's finished record) held: refused at once, however long the
    key's own holder holds it and however long the wait asked for."""
    assert guard.acquire("job", 30) is not None
    assert guard.acquire("job:done", 60) is not None
    started = time.monotonic()
    attempt = guard.try_acquire("job", 10, wait=20, unless="job:done")
    assert attempt.lease is None and attempt.holder is not None
    assert time.monotonic() - started < 5


def test_releases_notify_only_while_someone_waits(pg_url: str) -> None:
    """NOTIFY serializes committing transactions, so the hot path must not send it."""
    listener = psycopg.connect(_libpq(pg_url), autocommit=True)
    guard = TaskGuard(pg_url)
    try:
        listener.execute("LISTEN taskguard_release")
        for _ in range(20):
            lease = guard.acquire("quiet", 30)
            assert lease is not None and guard.release(lease)
        assert list(listener.notifies(timeout=0.3)) == []
        # Someone waits: the release wakes it (and the waiter gets the key).
        lease = guard.acquire("busy", 30)
        assert lease is not None
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        waiter = ctx.Process(target=_waiter, args=(pg_url, "busy", 20.0, out))
        waiter.start()
        # Release only once the waiter has announced itself (a slow start on a loaded
        # machine would otherwise find the key free and never wait).
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            row = listener.execute(
                "SELECT wanted_until IS NOT NULL FROM task_locks WHERE key = 'busy'"
            ).fetchone()
            if row and row[0]:
                break
            time.sleep(0.05)
        assert guard.release(lease)
        # (The waiter's own release right after its grant may arrive in the same batch.)
        woken = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
        assert woken and set(woken) == {"busy"}
        assert out.get(timeout=30)[0] == "granted"
        waiter.join(timeout=30)
    finally:
        guard.dispose()
        listener.close()


def test_a_granted_waiter_leaves_no_reservation_behind(db_url: str) -> None:
    """Once a waiter is granted, its place in line is used up: later releases free
    the key for anyone at once, not after RESERVE_GRACE (issue 16, item 3)."""
    key = "wait:reservation-used-up"
    guard, other = TaskGuard(db_url), TaskGuard(db_url)
    try:
        first = guard.acquire(key, 60)
        assert first is not None
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        waiter = ctx.Process(target=_waiter, args=(db_url, key, 10.0, out))
        waiter.start()
        time.sleep(1.0)  # let it announce itself
        assert guard.release(first)
        verdict, *_ = out.get(timeout=15)
        waiter.join(15)
        assert verdict == "granted"  # and it released the key again
        # Others, back to back: each release must leave the key free at once.
        _free_after_each_release(other, key, 3)
    finally:
        guard.dispose()
        other.dispose()


def _free_after_each_release(guard: TaskGuard, key: str, times: int) -> None:
    """Acquire ``key`` without waiting right after each release, ``times`` times: a
    waiter's reservation, were it still there, refuses that for RESERVE_GRACE."""
    for _ in range(times):
        lease = guard.acquire(key, 60)
        assert lease is not None, "a departed waiter's reservation still holds the key"
        assert guard.release(lease)


def _in_line(url: str, key: str, wait: float, out: Any) -> Any:
    """A process waiting up to ``wait`` s for ``key``, once it has announced itself."""
    ctx = mp.get_context("fork")
    in_line = ctx.Event()
    waiter = ctx.Process(target=_waiter, args=(url, key, wait, out, in_line))
    waiter.start()
    assert in_line.wait(30), "the waiter never announced itself"
    return waiter


def test_a_killed_waiter_stops_holding_up_the_key_within_its_reservation(db_url: str) -> None:
    """Issue 28 E: a SIGKILLed waiter's place in line lapses within RESERVATION
    seconds, not at the end of its whole wait: then a release frees the key for
    anyone at once again (no acquire refused while the key is free, no hand-over
    delayed by the reservation grace)."""
    key = "wait:killed-waiter"
    guard, other = TaskGuard(db_url), TaskGuard(db_url)
    try:
        holder = guard.acquire(key, 60)
        assert holder is not None
        waiter = _in_line(db_url, key, 120.0, mp.get_context("fork").Queue())
        os.kill(waiter.pid, signal.SIGKILL)  # it never withdraws
        waiter.join(timeout=30)
        time.sleep(RESERVATION + 0.5)
        assert guard.release(holder)
        _free_after_each_release(other, key, 5)
    finally:
        guard.dispose()
        other.dispose()


def test_a_live_waiter_keeps_its_place_beyond_one_reservation(db_url: str) -> None:
    """A waiter renews its place in line while it waits: long after its first
    announcement the row is still reserved for it (and the release goes to it)."""
    key = "wait:renewed-place"
    out = mp.get_context("fork").Queue()
    guard = TaskGuard(db_url)
    engine = create_engine(db_url, poolclass=NullPool)
    try:
        holder = guard.acquire(key, 60)
        assert holder is not None
        waiter = _in_line(db_url, key, 30.0, out)
        time.sleep(RESERVATION + 0.5)
        with engine.connect() as conn:
            next_owner, next_until = conn.execute(
                select(TaskLock.next_owner, TaskLock.next_until).where(TaskLock.key == key)
            ).one()
        info = guard.get(key)
        assert info is not None and next_owner not in (None, holder.owner)
        assert next_until > info.read_at, "the waiter's place in line lapsed"
        assert guard.release(holder)
        assert out.get(timeout=30)[0] == "granted"
        waiter.join(timeout=30)
        assert waiter.exitcode == 0
    finally:
        guard.dispose()
        engine.dispose()
