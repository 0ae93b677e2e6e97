"""A cancelled asyncio lease call leaves no lease behind (issue 41): cancelled while
its statement is in flight (held up by a row lock another connection holds), or while
it waits (``wait=``), by ``asyncio.wait_for``'s time-out or a task group, its grant is
given back, its wait abandoned, before the cancellation reaches the caller; a
cancelled release still releases."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import create_engine, update
from sqlalchemy.pool import NullPool

from taskguard import TaskGuard
from taskguard.models import TaskLock

#: When the call is cancelled, and when the row lock holding it up goes (seconds).
CANCEL_AT = 0.3
FREED_AT = 1.0


class RowLock:
    """Another connection's open transaction that has updated ``key``'s rows: until
    :meth:`free`, statements writing them wait (on SQLite: every write waits)."""

    def __init__(self, url: str, key: str) -> None:
        self._url, self._key = url, key
        self._locked, self._free = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)
        self._thread.start()
        assert self._locked.wait(10)

    def _hold(self) -> None:
        engine = create_engine(self._url, poolclass=NullPool)
        try:
            with engine.begin() as conn:
                row = TaskLock.key == self._key
                conn.execute(update(TaskLock).where(row).values(owner=TaskLock.owner))
                self._locked.set()
                self._free.wait(30)
        finally:
            engine.dispose()

    def free_after(self, seconds: float) -> None:
        threading.Timer(seconds, self._free.set).start()

    def join(self) -> None:
        self._free.set()
        self._thread.join(10)


def held(guard: TaskGuard, key: str) -> bool:
    info = guard.get(key)
    return info is not None and info.held


def stays_free(guard: TaskGuard, key: str, seconds: float = 1.0) -> bool:
    """Whether no lease on ``key`` shows up for ``seconds`` (a statement still on a
    worker thread would grant it), and another owner can then take it at once."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if held(guard, key):
            return False
        time.sleep(0.05)
    lease = guard.acquire(key, 30)
    return lease is not None and guard.release(lease)


async def _cancel(way: str, call: Callable[[], Awaitable[Any]]) -> None:
    """Run ``call()`` and cancel it at :data:`CANCEL_AT` the ``way`` named; return once
    the cancelled call has."""
    if way == "wait_for":
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call(), CANCEL_AT)
        return

    async def failing() -> None:
        await asyncio.sleep(CANCEL_AT)
        raise LookupError("a sibling task failed")

    with pytest.raises(ExceptionGroup) as failed:
        async with asyncio.TaskGroup() as group:
            group.create_task(call())
            group.create_task(failing())
    assert failed.group_contains(LookupError)  # and the call itself was cancelled


def _calls(guard: TaskGuard, key: str) -> dict[str, Callable[[], Awaitable[Any]]]:
    async def locked() -> None:
        async with guard.alock(key, 30):
            await asyncio.sleep(30)

    return {
        "aacquire": lambda: guard.aacquire(key, 30),
        "atry_acquire": lambda: guard.atry_acquire(key, 30),
        "alock": locked,
    }


@pytest.mark.parametrize(
    ("api", "way"),
    [
        ("aacquire", "wait_for"),
        ("atry_acquire", "task_group"),
        ("alock", "wait_for"),
        ("alock", "task_group"),
    ],
)
def test_a_call_cancelled_in_flight_leaves_no_lease(
    guard: TaskGuard, db_url: str, api: str, way: str
) -> None:
    """The acquire statement is held up by a row lock when the call is cancelled; the
    lock goes later. Before the fix the call returned at once and the statement then
    granted the lease on its thread, held for the whole ttl by no one."""
    key = f"cancel:{api}:{way}"
    old = guard.acquire(key, 30)
    assert old is not None and guard.release(old)  # the row the lock below holds up
    blocker = RowLock(db_url, key)
    try:

        async def scenario() -> None:
            blocker.free_after(FREED_AT)
            await _cancel(way, _calls(guard, key)[api])
            assert not held(guard, key)  # right after the cancelled call returned

        asyncio.run(scenario())
    finally:
        blocker.join()
    assert stays_free(guard, key)


def test_a_cancelled_waiting_acquire_leaves_the_line(guard: TaskGuard, db_url: str) -> None:
    """``aacquire(wait=…)`` cancelled while it waits: the wait ends promptly and gives
    up its place in line, so when the holder releases, anyone may take the key. Before
    the fix its thread went on waiting, kept the key reserved for itself after the
    release and then took it."""
    key = "cancel:wait"
    holder = guard.acquire(key, 30)
    assert holder is not None

    async def scenario() -> float:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(guard.aacquire(key, 30, wait=20), CANCEL_AT)
        took = time.monotonic() - started
        assert guard.release(holder)
        taken = guard.try_acquire(key, 30)
        assert taken.lease is not None, f"refused: {taken.holder}"
        assert guard.release(taken.lease)
        assert stays_free(guard, key)  # the cancelled waiter takes nothing later
        return took

    # The wait ends at its next wake-up (at most RENEW_EVERY, 0.5 s) and withdraws:
    # far below the 20 s it asked for, with room for a loaded machine.
    took = asyncio.run(scenario())
    print(f"cancelled at {CANCEL_AT}s, the waiting call returned after {took:.2f}s")
    assert took < 5


@pytest.mark.parametrize("api", ["arelease", "arenew"])
def test_a_cancelled_release_or_renewal_completes(guard: TaskGuard, db_url: str, api: str) -> None:
    """``arelease`` (``arenew``) cancelled while its statement is held up completes the
    release (renewal) before the cancellation reaches the caller (before the fix the
    caller went on with the key still held, the lease not yet renewed)."""
    key = f"cancel:{api}"
    lease = guard.acquire(key, 30)
    assert lease is not None
    blocker = RowLock(db_url, key)
    try:

        async def scenario() -> None:
            blocker.free_after(FREED_AT)
            if api == "arelease":
                await _cancel("wait_for", lambda: guard.arelease(lease))
                assert not held(guard, key)
            else:
                await _cancel("wait_for", lambda: guard.arenew(lease, 300))
                info = guard.get(key)
                assert info is not None and info.owner == lease.owner
                assert (info.expires_at - guard.db_now()).total_seconds() > 200

        asyncio.run(scenario())
    finally:
        blocker.join()
    assert guard.release(lease) == (api == "arenew")
    assert stays_free(guard, key, 0.1)


def test_alock_cancelled_again_while_releasing_releases(guard: TaskGuard, db_url: str) -> None:
    """The body of ``alock`` is cancelled, and its task again while the release on the
    way out is held up (a task group cancelling, then a shutdown): the lease is still
    given back before the task ends (before the fix, the second cancellation left the
    release running on its thread)."""
    key = "cancel:alock-exit"
    entered = asyncio.Event()

    async def body() -> None:
        async with guard.alock(key, 30):
            entered.set()
            await asyncio.sleep(30)

    async def scenario() -> None:
        task = asyncio.create_task(body())
        await entered.wait()
        blocker = RowLock(db_url, key)
        try:
            blocker.free_after(FREED_AT)
            task.cancel()
            await asyncio.sleep(CANCEL_AT)  # the release is in flight, held up
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not held(guard, key)
        finally:
            blocker.join()

    asyncio.run(scenario())
    assert stays_free(guard, key)
