"""Lock history (``TaskGuard(..., history=True)``) and ``taskguard explain KEY``:
a scripted scenario played by real processes, read back through the real CLI."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import REDIS_URL
from integration.celery.workers import start_worker
from sqlalchemy import create_engine, text

from taskguard import TaskGuard

KEY = "feed:42"
_SCRIPT = shutil.which("taskguard", path=str(Path(sys.executable).parent))
TASKGUARD = (
    [_SCRIPT] if _SCRIPT else [sys.executable, "-c", "from taskguard.cli import main; main()"]
)


def _crashing_importer(url: str) -> None:
    guard = TaskGuard(url, history=True)
    # Long enough that t2 is turned away and t3 must wait, even on a loaded machine
    # (t2 is a new process, its connection too: 2 s is thin at a load of 15-20).
    assert guard.acquire(KEY, 5.0, task_name="import_feed", task_id="t1") is not None
    os._exit(0)  # dies holding the lease: no release


def _turned_away(url: str, out: Any) -> None:
    guard = TaskGuard(url, history=True)
    out.put(guard.acquire(KEY, 30, task_name="import_feed", task_id="t2") is None)
    guard.dispose()


def _patient(url: str, out: Any) -> None:
    guard = TaskGuard(url, history=True)
    lease = guard.acquire(KEY, 30, task_name="import_feed", task_id="t3", wait=30)
    assert lease is not None
    time.sleep(0.1)
    out.put(guard.release(lease))
    guard.dispose()


def _run(target: Any, *args: Any) -> None:
    p = mp.get_context("fork").Process(target=target, args=args)
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 0


def _explain(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TASKGUARD, "explain", KEY, "--database-url", url, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_explain_tells_the_story_of_a_scripted_scenario(db_url: str) -> None:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    # t1 takes the key and crashes; t2 is turned away; t3 waits, takes it over when
    # t1's lease expires and releases it; an operator's lease is force-released;
    # the reaper removes the row.
    _run(_crashing_importer, db_url)
    _run(_turned_away, db_url, out)
    assert out.get(timeout=10) is True
    _run(_patient, db_url, out)
    assert out.get(timeout=10) is True
    ops = TaskGuard(db_url, history=True)
    try:
        lease = ops.acquire(KEY, 30, task_name="manual_fix")
        assert lease is not None
        assert ops.force_release(KEY)
        assert ops.renew(lease) is False  # the operator's own lease is lost
        assert ops.reap(grace=0) == 1
        events = ops.events(KEY)
    finally:
        ops.dispose()

    story = [(e.event, e.holder.task_id or e.holder.task_name) for e in events]
    assert story == [
        ("acquired", "t1"),
        ("conflict", "t2"),
        ("taken_over", "t1"),
        ("acquired", "t3"),
        ("released", "t3"),
        ("acquired", "manual_fix"),
        ("force_released", "manual_fix"),
        ("lost", "manual_fix"),
        ("reaped", "manual_fix"),
    ]
    by_kind = {e.event: e for e in events}
    assert by_kind["taken_over"].duration is not None and by_kind["taken_over"].duration >= 0.3
    assert by_kind["acquired"].token is not None
    assert 0.1 <= (by_kind["released"].duration or 0) < 5
    tokens = [e.token for e in events if e.event == "acquired"]
    assert tokens == sorted(tokens)

    run = _explain(db_url)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"lock {KEY!r}"
    kinds = [
        next(word for word in ("acquired", "turned away", "taken over", "released", "lost",
                               "force-released", "reaped") if f"  {word}" in line)
        for line in lines[2:-1]
    ]  # fmt: skip
    assert kinds == [
        "acquired",
        "turned away",
        "taken over",
        "acquired",
        "released",
        "acquired",
        "force-released",
        "lost",
        "reaped",
    ]
    assert "task import_feed id t2" in lines[3] and "held by owner" in lines[3]
    assert "lease expired without release" in lines[4]
    assert "waited" in lines[5]
    assert lines[-1] == "now: free (no row)"

    as_json = _explain(db_url, "--json", "--limit", "3")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert [e["event"] for e in data["events"]] == ["force_released", "lost", "reaped"]
    assert data["rows"] == []

    missing = subprocess.run(
        [*TASKGUARD, "explain", "nope", "--database-url", db_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "nothing recorded" in missing.stderr


def test_explain_without_history_says_how_to_turn_it_on(sqlite_url: str) -> None:
    """A Celery user was told only ``TaskGuard(..., history=True)``."""
    guard = TaskGuard(sqlite_url)
    try:
        assert guard.acquire(KEY, 30) is not None
    finally:
        guard.dispose()
    run = _explain(sqlite_url)
    assert run.returncode == 0, run.stderr
    assert "app.conf.taskguard_history = True" in run.stdout
    assert "TASKGUARD_HISTORY = True" in run.stdout and "history=True" in run.stdout


def test_history_off_records_nothing_and_adds_no_statement(guard: TaskGuard) -> None:
    sent: list[str] = []
    run = guard._store._db.run

    def counted(stmt: Any, values: dict[str, Any], deadline: float | None = None) -> Any:
        sent.append(stmt.sql)
        return run(stmt, values, deadline)

    guard._store._db.run = guard._store.run = counted  # type: ignore[method-assign]
    lease = guard.acquire(KEY, 30)
    assert lease is not None and guard.renew(lease) and guard.release(lease)
    assert len(sent) == 3
    assert not any("task_lock_events" in sql for sql in sent)
    assert guard.events(KEY) == []


def test_history_is_trimmed_by_age(db_url: str) -> None:
    guard = TaskGuard(db_url, history=True, history_retention=3600)
    try:
        for _ in range(3):
            lease = guard.acquire(KEY, 30)
            assert lease is not None and guard.release(lease)
        assert len(guard.events(KEY)) == 6
        assert guard.reap(grace=0) == 1  # the retention keeps recent events
        assert len(guard.events(KEY)) == 7
        time.sleep(0.05)
        assert guard.trim_history(0.01, batch_size=2) == 8  # and the reaper's run
        assert guard.events(KEY) == []
    finally:
        guard.dispose()


def test_recent_events_read_every_key_even_reaped_ones(db_url: str) -> None:
    guard, quiet = TaskGuard(db_url, history=True), TaskGuard(db_url)
    try:
        since = guard.db_now()
        for key, task in (("a", "app.one"), ("b", "app.two")):
            assert guard.acquire(key, 0.2)
            assert guard.try_acquire(key, 30, task_name=task).lease is None
        time.sleep(0.3)
        assert guard.reap(grace=0, by="alice") == 2
        conflicts = guard.recent_events(since=since, kinds=["conflict"])
        assert [(e.key, e.holder.task_name) for e in conflicts] == [
            ("a", "app.one"),
            ("b", "app.two"),
        ]
        assert [e.key for e in guard.recent_events(since=since, kinds=["conflict"], limit=1)] == [
            "b"
        ]
        assert len(guard.recent_events(since=since)) == 7  # 2 x (acquired, conflict, reaped), reap
        (run,) = guard.recent_events(since=since, kinds=["reap", "coalesced"])
        assert run.key == "taskguard:reaper"
        assert run.detail == "removed 2 row(s) in 1 batch(es); requested by alice"
        assert quiet.reap(grace=0) == 0 and quiet.reap(grace=0, by="bob") == 0
        runs = guard.recent_events(since=since, kinds=["reap"])
        assert [r.detail for r in runs][1:] == ["removed 0 row(s) in 1 batch(es); requested by bob"]
        assert guard.recent_events(since=guard.db_now() + timedelta(hours=1)) == []
        with pytest.raises(ValueError, match="kinds must be event names"):
            guard.recent_events(since=since, kinds=["conflicts"])
    finally:
        guard.dispose()
        quiet.dispose()


def test_an_exclusive_adoption_is_a_hand_over_in_the_story(db_url: str) -> None:
    guard = TaskGuard(db_url, history=True)
    try:
        lease = guard.acquire(KEY, 30, task_id="id1", hostname="publisher")
        assert lease is not None
        mine = guard.adopt(KEY, lease.owner, 30, exclusive=True, task_id="id1", hostname="w1")
        assert mine is not None and guard.release(mine)
        story = [(e.event, e.owner, e.holder.hostname) for e in guard.events(KEY)]
        assert story == [
            ("acquired", lease.owner, "publisher"),
            ("released", lease.owner, "publisher"),
            ("acquired", mine.owner, "w1"),
            ("released", mine.owner, "w1"),
        ]
        text = guard.explain(KEY)
        assert f"handed over to owner {mine.owner}" in text
        assert f"handed over by owner {lease.owner}" in text
    finally:
        guard.dispose()


# -- normal hand-overs are not crashes (issue 27, item 3) ---------------------------------

HANDOVERS = 2_000


def _hand_over(url: str, name: str, grants: int, start: Any, out: Any) -> None:
    """Take the key, give it back at once, ``grants`` times (ttl 30 s: a lease only
    ever ends by its release)."""
    guard = TaskGuard(url, history=True)
    start.wait(30)
    got = 0
    try:
        while got < grants:
            lease = guard.acquire(
                "handover", 30, task_name=name, task_id=f"{name}-{got}", pid=os.getpid()
            )
            if lease is not None:
                got += 1
                assert guard.release(lease)
        out.put((name, got))
    finally:
        guard.dispose()


def _stored(url: str) -> list[tuple[Any, ...]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [
                tuple(r)
                for r in conn.execute(
                    text(
                        "SELECT event, owner, task_name, task_id, hostname, pid"
                        " FROM task_lock_events WHERE `key` = 'handover'"
                        if engine.dialect.name in ("mysql", "mariadb")
                        else "SELECT event, owner, task_name, task_id, hostname, pid"
                        " FROM task_lock_events WHERE key = 'handover'"
                    )
                )
            ]
    finally:
        engine.dispose()


def test_hand_overs_are_never_recorded_as_takeovers(db_url: str) -> None:
    """Two processes hand one key back and forth: every lease ends by its release, so
    the story has no "taken over" (19 of 800 grants were, from the order in which the
    events were written), and every release names its holder."""
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_hand_over, args=(db_url, name, HANDOVERS // 2, start, out))
        for name in ("left", "right")
    ]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0
    assert sorted(out.get(timeout=10) for _ in procs) == [
        ("left", HANDOVERS // 2),
        ("right", HANDOVERS // 2),
    ]
    stored = _stored(db_url)
    kinds = [row[0] for row in stored]
    assert kinds.count("acquired") == HANDOVERS and kinds.count("released") == HANDOVERS
    assert kinds.count("taken_over") == 0
    released = [row for row in stored if row[0] == "released"]
    assert all(row[2] in ("left", "right") and row[3] and row[4] and row[5] for row in released)
    guard = TaskGuard(db_url, history=True)
    try:
        story = guard.events("handover", limit=10 * HANDOVERS)
        assert not [e for e in story if e.event == "taken_over"]
        assert "taken over" not in guard.explain("handover", limit=200)
    finally:
        guard.dispose()


_CELERY_APP = """
import os

from celery import Celery

from taskguard import guarded_task

app = Celery("historyapp", broker=os.environ["TASKGUARD_TEST_BROKER_URL"])
app.conf.update(
    result_backend=os.environ["TASKGUARD_TEST_BROKER_URL"],
    task_default_queue=os.environ["TASKGUARD_TEST_QUEUE"],
    taskguard_database_url=os.environ["TASKGUARD_DATABASE_URL"],
    taskguard_history=True,
)


@guarded_task(app=app, name="hist.run", key="hist:{n}", ttl=30)
def run(n):
    return n


@guarded_task(app=app, name="hist.queued", key="histq:{n}", ttl=30, lock="queue_and_run")
def queued(n):
    return n
"""


def test_releases_by_the_celery_glue_name_their_holder(pg_url: str, tmp_path: Path) -> None:
    """``released`` events written by a worker carried no task, host or pid (the
    admin showed "-"); both lock phases' releases name them now."""
    (tmp_path / "historyapp.py").write_text(_CELERY_APP)
    with start_worker(
        "historyapp", REDIS_URL, pg_url, concurrency=2, pythonpath=(tmp_path,)
    ) as worker:
        env = {
            "TASKGUARD_TEST_BROKER_URL": REDIS_URL,
            "TASKGUARD_TEST_QUEUE": worker.queue,
            "TASKGUARD_DATABASE_URL": pg_url,
        }
        publish = (
            "import sys; sys.path.insert(0, sys.argv[1]); import historyapp as h\n"
            "rs = [h.run.delay(i % 3) for i in range(12)] + [h.queued.delay(i) for i in range(6)]\n"
            "print(sum(1 for r in rs if r.get(timeout=60) is not None))"
        )
        done = subprocess.run(
            [sys.executable, "-c", publish, str(tmp_path)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            released = conn.execute(
                text(
                    "SELECT key, task_name, task_id, hostname, pid FROM task_lock_events"
                    " WHERE event = 'released'"
                )
            ).all()
            kinds = dict(
                conn.execute(text("SELECT event, count(*) FROM task_lock_events GROUP BY 1")).all()
            )
    finally:
        engine.dispose()
    assert {r.key.split(":")[0] for r in released} == {"hist", "histq"}, released
    assert all(r.task_name in ("hist.run", "hist.queued") for r in released), released
    assert all(r.task_id and r.hostname and r.pid for r in released), released
    assert "taken_over" not in kinds, kinds
