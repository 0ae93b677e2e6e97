"""The renewer on its own: a real lease on PostgreSQL, renewed by the heartbeat
thread; an unreachable database (a closed port, not a mock) makes it lost."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from taskguard import Lease, LeaseLost, TaskGuard, held_lease, signals
from taskguard.held_lease import (
    Hold,
    check_lease,
    current_lease,
    enter_run,
    exit_run,
)

UNREACHABLE = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere?connect_timeout=1"


@pytest.fixture
def dead_guard() -> Iterator[TaskGuard]:
    g = TaskGuard(UNREACHABLE)
    yield g
    g.dispose()


def test_heartbeat_renews_until_stopped(pg_guard: TaskGuard) -> None:
    lease = pg_guard.acquire("k", 1.0)
    assert lease is not None
    first_expiry = lease.expires_at
    run = Hold(pg_guard, "k", lease, request=None)
    run.start_renewing()
    beat = run
    try:
        time.sleep(2.2)  # more than two ttls
        info = pg_guard.get("k")
        assert info is not None and info.held and info.owner == lease.owner
        assert lease.expires_at > first_expiry and run.lost is None
    finally:
        beat.stop_renewing()
    assert held_lease.renewing() == 0
    time.sleep(1.2)
    info = pg_guard.get("k")
    assert info is not None and not info.held  # nobody renews after stop()


def test_unreachable_database_loses_the_lease_when_it_runs_out(
    pg_guard: TaskGuard, dead_guard: TaskGuard, caplog: pytest.LogCaptureFixture
) -> None:
    lease = pg_guard.acquire("k", 1.0)
    assert lease is not None
    run = Hold(dead_guard, "k", lease, request=None)
    lost: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kw: Any) -> None:
        lost.append(kw)

    signals.lease_lost.connect(receiver, weak=False)
    caplog.set_level(logging.WARNING, logger="taskguard.celery")
    token = enter_run(run)
    run.start_renewing()
    beat = run
    try:
        deadline = time.monotonic() + 5
        while run.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(run.lost, LeaseLost) and "ran out" in run.lost.reason
        with pytest.raises(LeaseLost):
            current_lease()
        assert current_lease(check=False) is lease
    finally:
        beat.stop_renewing()
        exit_run(token)
        signals.lease_lost.disconnect(receiver)
    assert lost and lost[0]["key"] == "k"
    messages = [r.getMessage() for r in caplog.records]
    assert any("could not renew lock 'k'" in m for m in messages)  # retried first
    assert any(m.startswith("lost lock 'k'") for m in messages)


def test_handed_over_lease_is_not_reported_lost(pg_guard: TaskGuard) -> None:
    # 3 s, not 0.3 s: on a loaded machine the lease ran out before the release.
    lease = pg_guard.acquire("k", 3)
    assert lease is not None
    run = Hold(pg_guard, "k", lease, request=None)
    run.start_renewing()
    beat = run
    try:
        run.handed_over = True
        assert pg_guard.release(lease)  # the retried run finished and released it
        time.sleep(1.5)  # past the renewer's look at ttl/3
        assert run.lost is None
    finally:
        beat.stop_renewing()


def test_a_stopped_hold_is_not_kept_by_the_renewer(pg_guard: TaskGuard) -> None:
    lease = pg_guard.acquire("k", 5)
    assert lease is not None
    run = Hold(pg_guard, "k", lease, request=None)
    run.start_renewing()
    ref = weakref.ref(run)
    run.stop_renewing()
    del run
    deadline = time.monotonic() + 10  # the renewer's loop may still name it until it wakes
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert ref() is None  # nothing renews (or keeps) a run after it stopped


def _renewer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "taskguard-renewer"]


def test_one_renewer_thread_serves_every_run_and_exits_when_idle(pg_guard: TaskGuard) -> None:
    # 3 s: renewals every ttl/3 must keep up on a loaded machine (0.6 s lost one there).
    leases = [pg_guard.acquire(f"k{i}", 3) for i in range(3)]
    assert all(lease is not None for lease in leases)
    first = [lease.expires_at for lease in leases if lease is not None]
    beats = [Hold(pg_guard, lease.key, lease, request=None) for lease in leases if lease]
    for beat in beats:
        beat.start_renewing()
    try:
        while pg_guard.db_now() <= max(first):  # past the first ttl: only renewals keep them
            time.sleep(0.05)
        assert len(_renewer_threads()) == 1
        assert held_lease.renewing() == 3
        for lease, before in zip(leases, first, strict=True):
            assert lease is not None and lease.expires_at > before
            info = pg_guard.get(lease.key)
            assert info is not None and info.held
    finally:
        for beat in beats:
            beat.stop_renewing()
    assert held_lease.renewing() == 0
    deadline = time.monotonic() + held_lease.IDLE_EXIT + 2
    while _renewer_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _renewer_threads()


def test_stopped_heartbeats_do_not_pile_up(pg_guard: TaskGuard) -> None:
    lease = pg_guard.acquire("k", 300)
    assert lease is not None
    run = Hold(pg_guard, "k", lease, request=None)
    for _ in range(500):  # a short task each, far quicker than its ttl/3
        (run.start_renewing(), run.stop_renewing())
    assert held_lease.renewing() == 0
    assert not held_lease._RENEWER.holds


def test_short_runs_do_not_wake_the_renewer(
    pg_guard: TaskGuard, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wake-up per run (a thread switch per task) cost more CPU than the rest of
    # the run side; a run far shorter than ttl/3 must leave the thread asleep.
    lease = pg_guard.acquire("k", 300)
    assert lease is not None
    run = Hold(pg_guard, "k", lease, request=None)
    (run.start_renewing(), run.stop_renewing())  # the thread exists from here on
    time.sleep(0.05)
    renewer = held_lease._RENEWER
    cond = renewer._cond
    wakes: list[int] = []
    real_notify = cond.notify
    monkeypatch.setattr(cond, "notify", lambda n=1: (wakes.append(n), real_notify(n)))
    for _ in range(50):
        (run.start_renewing(), run.stop_renewing())
        time.sleep(0.002)  # as between tasks: the thread could run here
    assert wakes == []
    # A run due before the thread's next look is still renewed on time.
    # (3 s, not 0.3 s: a loaded machine's renewer took longer than 0.25 s to get there.)
    short_lease = pg_guard.acquire("k2", 3)
    assert short_lease is not None
    first_expiry = short_lease.expires_at
    beat = Hold(pg_guard, "k2", short_lease, request=None)
    beat.start_renewing()
    try:
        while short_lease.expires_at == first_expiry and pg_guard.db_now() < first_expiry:
            time.sleep(0.05)
        assert short_lease.expires_at > first_expiry
    finally:
        beat.stop_renewing()


def test_the_lease_runs_out_by_the_local_clock_without_the_renewer() -> None:
    """check_lease() and current_lease() read this host's clock: a lease whose last
    confirmation is older than ttl - margin counts as lost, whatever the renewer
    (here: none at all) is doing."""
    now = datetime.now(timezone.utc)
    lease = Lease("k", "o", 1, now, now + timedelta(seconds=1), 1.0, confirmed_at=time.monotonic())
    run = Hold(None, "k", lease, request=None)  # type: ignore[arg-type]
    token = enter_run(run)
    try:
        assert check_lease() is lease and current_lease() is lease
        time.sleep(1.0 - held_lease.MARGIN + 0.05)
        with pytest.raises(LeaseLost, match="ran out by this host's clock"):
            check_lease()
        with pytest.raises(LeaseLost):
            current_lease()
        assert current_lease(check=False) is lease
    finally:
        exit_run(token)
