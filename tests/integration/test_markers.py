"""Markers: ``release(lease, marker=...)`` takes a second key with the release (one
statement on PostgreSQL), and ``try_acquire(..., unless=...)`` is refused while
that key is held (inside the acquire statement on PostgreSQL and SQLite). The
Celery integration records finished task ids this way (issue 16.1, issue 18)."""

from __future__ import annotations

import time

import pytest

from taskguard import Holder, InvalidKey, InvalidTTL, Marker, TaskGuard


def test_a_marker_refuses_the_acquire_it_names(guard: TaskGuard) -> None:
    lease = guard.acquire("job", 30, task_id="t1")
    assert lease is not None
    done = Marker("done:t1", 30, Holder(task_name="job", task_id="t1"))
    assert guard.release(lease, marker=done) is True
    assert guard.get("job") is not None and not guard.get("job").held  # type: ignore[union-attr]
    info = guard.get("done:t1")
    assert info is not None and info.held and info.holder.task_id == "t1"
    assert info.holder.hostname == guard.hostname and info.holder.pid is not None

    refused = guard.try_acquire("job", 30, task_id="t1", unless="done:t1")
    assert refused.lease is None
    assert refused.holder is not None and refused.holder.key == "done:t1"  # the reason
    assert guard.get("job") is not None and not guard.get("job").held  # type: ignore[union-attr]

    other = guard.try_acquire("job", 30, task_id="t2", unless="done:t2")
    assert other.lease is not None and other.lease.token > lease.token


def test_a_held_key_is_reported_before_the_marker(guard: TaskGuard) -> None:
    holder = guard.acquire("job", 30, task_id="a")
    assert holder is not None
    guard.release(guard.acquire("other", 30) or pytest.fail("free"), marker=Marker("done:b", 30))
    refused = guard.try_acquire("job", 30, task_id="b", unless="done:b")
    assert refused.lease is None and refused.holder is not None
    assert refused.holder.owner == holder.owner


def test_the_marker_is_taken_even_when_the_lease_was_lost(guard: TaskGuard) -> None:
    lease = guard.acquire("job", 1)
    assert lease is not None
    assert guard.force_release("job")
    assert guard.release(lease, marker=Marker("done:x", 30)) is False
    assert guard.get("done:x") is not None and guard.get("done:x").held  # type: ignore[union-attr]


def test_an_expired_marker_no_longer_refuses(guard: TaskGuard) -> None:
    lease = guard.acquire("job", 30)
    assert lease is not None
    guard.release(lease, marker=Marker("done:y", 0.2))
    assert guard.try_acquire("job", 30, unless="done:y").lease is None
    time.sleep(0.3)
    assert guard.try_acquire("job", 30, unless="done:y").lease is not None


def test_a_second_marker_leaves_the_first_in_place(guard: TaskGuard) -> None:
    first = guard.acquire("job", 30)
    assert first is not None
    guard.release(first, marker=Marker("done:z", 30, Holder(task_id="one")))
    second = guard.acquire("job", 30)
    assert second is not None
    guard.release(second, marker=Marker("done:z", 30, Holder(task_id="two")))
    info = guard.get("done:z")
    assert info is not None and info.holder.task_id == "one"


def test_unless_with_a_limit_and_a_wait(guard: TaskGuard) -> None:
    lease = guard.acquire("pool", 30, limit=2)
    assert lease is not None
    guard.release(lease, marker=Marker("done:p", 30))
    assert guard.try_acquire("pool", 30, limit=2, unless="done:p").lease is None
    started = time.monotonic()
    assert guard.try_acquire("pool", 30, limit=2, unless="done:p", wait=0.3).lease is None
    assert time.monotonic() - started < 5
    assert guard.try_acquire("pool", 30, limit=2, unless="done:q").lease is not None


def test_bad_markers_are_refused_before_anything_is_written(guard: TaskGuard) -> None:
    lease = guard.acquire("job", 30)
    assert lease is not None
    with pytest.raises(InvalidKey, match="lease's own key"):
        guard.release(lease, marker=Marker("job", 30))
    with pytest.raises(InvalidTTL):
        guard.release(lease, marker=Marker("done:j", -1))
    assert guard.is_held_by(lease)
    assert guard.get("done:j") is None


def test_a_marker_with_a_throttle_window(guard: TaskGuard) -> None:
    lease = guard.acquire("slow", 30, min_hold=5)
    assert lease is not None
    assert guard.release(lease, marker=Marker("done:h", 30)) is True
    assert guard.get("done:h") is not None and guard.get("done:h").held  # type: ignore[union-attr]
    assert guard.acquire("slow", 30) is None  # the window still holds the key
