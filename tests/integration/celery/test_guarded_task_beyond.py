"""@guarded_task beyond a mutex (issue #8): concurrency limits, throttle windows,
waiting for the key, and hand-offs carrying slot and window. Eager mode on a real
PostgreSQL database private to each test."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from celery import Celery
from celery._state import _set_task_join_will_block

from taskguard import TaskGuard, current_lease, guarded_task, is_skipped
from taskguard.celery.message import Header
from taskguard.celery.worker import release_dead_run
from taskguard.config import reset_guards


@pytest.fixture
def app(pg_url: str) -> Iterator[Celery]:
    app = Celery("tg_beyond", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, taskguard_database_url=pg_url
    )
    yield app
    reset_guards()


@pytest.fixture
def guard(pg_url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(pg_url)
    yield g
    g.dispose()


def test_limit_lets_two_runs_in_and_turns_the_third_away(app: Celery, guard: TaskGuard) -> None:
    inside = threading.Barrier(3, timeout=20)
    leave = threading.Event()
    slots: list[int] = []

    @guarded_task(app=app, shared=False, key="report", ttl=30, limit=2)
    def report() -> str:
        lease = current_lease()
        assert lease is not None
        slots.append(lease.slot)
        inside.wait()
        assert leave.wait(20)
        return "done"

    results: list[object] = []
    runners = [
        threading.Thread(target=lambda: results.append(report.delay().result)) for _ in range(2)
    ]
    for t in runners:
        t.start()
    try:
        inside.wait()  # both runs hold a slot now
        # .result, not .get(): Celery refuses get() while an eager task runs.
        assert is_skipped(report.delay().result)
        assert sorted(i.slot for i in guard.get_all("report") if i.held) == [0, 1]
    finally:
        leave.set()
        for t in runners:
            t.join(20)
        # Eager apply() sets a process-global "joins would block" flag and restores
        # the value it saw: two overlapping runs leave it stuck at True.
        _set_task_join_will_block(False)
    assert results == ["done", "done"] and sorted(slots) == [0, 1]
    assert not any(i.held for i in guard.get_all("report"))
    # Slots taken outside Celery count too: both taken, the task is turned away.
    assert guard.acquire("report", 30, limit=2) is not None
    assert guard.acquire("report", 30, limit=2) is not None
    assert is_skipped(report.delay().get()) and len(slots) == 2


def test_min_hold_keeps_the_key_after_the_run_returned(app: Celery, guard: TaskGuard) -> None:
    ran: list[float] = []

    @guarded_task(app=app, shared=False, key="mail", ttl=10, min_hold=1.5)
    def mail() -> None:
        ran.append(time.monotonic())

    assert mail.delay().get() is None
    info = guard.get("mail")
    assert info is not None and info.held  # the window, by the database clock
    assert info.expires_at - info.acquired_at >= timedelta(seconds=1.5)
    assert is_skipped(mail.delay().get()) and len(ran) == 1
    left = (info.expires_at - guard.db_now()).total_seconds()
    time.sleep(max(left, 0) + 0.05)
    assert mail.delay().get() is None and len(ran) == 2


def test_wait_runs_once_the_holder_releases(app: Celery, guard: TaskGuard) -> None:
    @guarded_task(app=app, shared=False, key="import", ttl=10, on_conflict="wait", wait_timeout=20)
    def do_import() -> str:
        return "imported"

    held = guard.acquire("import", 30, task_name="holder.task")
    assert held is not None
    timer = threading.Timer(0.5, guard.release, (held,))
    started = time.monotonic()
    timer.start()
    try:
        assert do_import.delay().get() == "imported"
    finally:
        timer.join()
    elapsed = time.monotonic() - started
    # Woken by the release, far before the 20 s timeout (slack for a loaded machine).
    assert 0.4 <= elapsed < 4, elapsed


def test_wait_timeout_gives_a_skipped_result(
    app: Celery, guard: TaskGuard, caplog: pytest.LogCaptureFixture
) -> None:
    @guarded_task(app=app, shared=False, key="sync", ttl=10, on_conflict="wait", wait_timeout=0.3)
    def sync() -> None: ...

    @guarded_task(app=app, shared=False, key="sync", ttl=10, on_conflict="wait")
    def sync_default() -> None: ...

    app.conf.taskguard_wait_timeout = 0.2
    caplog.set_level(logging.WARNING, logger="taskguard.celery")
    with guard.lock("sync", 30, task_id="holder-id"):
        started = time.monotonic()
        value = sync.delay().get()
        assert time.monotonic() - started >= 0.3
        assert is_skipped(value) and value["holder"]["task_id"] == "holder-id"
        assert is_skipped(sync_default.delay().get())
    message = next(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    assert "after waiting" in message and "holder-id" in message and "'sync'" in message


def test_queue_hand_off_carries_the_slot_and_the_window(app: Celery, guard: TaskGuard) -> None:
    seen: list[tuple[int, float]] = []

    @guarded_task(
        app=app, shared=False, key="export", ttl=10, lock="queue_and_run", limit=2, min_hold=30
    )
    def export() -> None:
        lease = current_lease()
        assert lease is not None
        seen.append((lease.slot, lease.min_hold))

    # Slot 0 taken: the task's lease is slot 1, which the worker must adopt by slot.
    assert guard.acquire("export", 30, slot=0) is not None
    assert export.delay().get() is None
    assert seen == [(1, 30.0)]
    row = next(i for i in guard.get_all("export") if i.slot == 1)
    assert row.held and row.expires_at - row.acquired_at >= timedelta(seconds=29)


def test_cleanup_after_a_dead_child_keeps_the_window(app: Celery, guard: TaskGuard) -> None:
    @guarded_task(app=app, shared=False, key="feed", ttl=10, min_hold=30)
    def feed() -> None: ...

    lease = guard.acquire("feed", 10, min_hold=30, task_id="dead-id", hostname="node@x", pid=4242)
    assert lease is not None
    released = release_dead_run(
        feed,
        task_id="dead-id",
        nodename="node@x",
        pid=4242,
        header=Header("feed"),
        args=(),
        kwargs={},
        why="test",
    )
    assert released == 1
    info = guard.get("feed")
    assert info is not None and info.held  # the owner is gone, the window stays
    assert info.expires_at - info.acquired_at >= timedelta(seconds=29)
