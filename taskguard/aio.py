"""The lease API for asyncio, as :class:`~taskguard.TaskGuard` methods: each call runs
the sync method's (short) statement on one of the guard's two lease threads (a call
with ``wait=`` on the loop's default executor, where it holds up no other call), so
the event loop is never blocked; the lease rules are the sync methods'.

Two threads, not ``asyncio.to_thread``'s pool (up to cores + 4): each thread busy with
a statement's Python work is one more the loop waits behind for the GIL, up to the
5 ms switch interval each time (tests/integration/test_async_guard.py, 100 coroutines
on 2 cores, Python 3.11: p99 lag about 8 ms on that pool, 3 ms on two threads).

A statement on a thread outlives a coroutine cancelled while awaiting it, so a
cancelled call (a time-out, a task group's or a request's cancellation) first waits
for its thread, whatever further cancellations come: a grant made for it is given
back, a release or renewal completes, a ``wait=`` stops at its next wake-up
(:data:`taskguard.waiting.abandoned`) and leaves the line. Then the cancellation goes
on. Each statement ends within the guard's ``call_timeout``, so the wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, TypeVar

from taskguard.exceptions import LockHeld, TaskGuardError
from taskguard.lease import Attempt, Lease
from taskguard.validation import normalize_key
from taskguard.waiting import abandoned

__all__ = ["AsyncLeases"]

_T = TypeVar("_T")

log = logging.getLogger("taskguard")


class AsyncLeases:
    """``aacquire``, ``atry_acquire``, ``arelease``, ``arenew`` and ``alock``."""

    # The sync API they run (TaskGuard's methods).
    acquire: Callable[..., Lease | None]
    try_acquire: Callable[..., Attempt]
    release: Callable[..., bool]
    renew: Callable[..., bool]
    # The lease threads, made on first use and again in a forked child (the parent's
    # threads do not survive a fork); they end with dispose() or with the guard.
    _lease_threads: tuple[int, ThreadPoolExecutor] | None = None

    def _end_lease_threads(self) -> None:
        """Let the lease threads exit (a call still queued is cancelled)."""
        threads, self._lease_threads = self._lease_threads, None
        if threads is not None and threads[0] == os.getpid():
            threads[1].shutdown(wait=False, cancel_futures=True)

    def _threads(self) -> ThreadPoolExecutor:
        threads = self._lease_threads
        if threads is None or threads[0] != os.getpid():
            threads = self._lease_threads = (os.getpid(), ThreadPoolExecutor(2, "taskguard-aio"))
        return threads[1]

    async def _off_loop(
        self, grants: bool, sync: Callable[..., _T], *args: Any, **kwargs: Any
    ) -> _T:
        """``sync(*args, **kwargs)`` on a lease thread (a ``wait=`` on the loop's default
        executor: it blocks its thread for the whole wait); ``grants``: it returns a
        Lease or an Attempt, given back if the caller is cancelled."""
        call = _Call(self.release if grants else None)
        job = functools.partial(contextvars.copy_context().run, call, sync, *args, **kwargs)
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(None if kwargs.get("wait") else self._threads(), job)
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            granted = call.abandon()
            if granted is not None:  # granted before the cancellation: give it back
                running = loop.run_in_executor(self._threads(), call.give_back, granted)
            while not running.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([running])
            if not running.cancelled() and running.exception() is not None:
                log.debug("a cancelled call failed on its thread: %s", running.exception())
            raise

    async def aacquire(self, key: str, ttl: float | timedelta, **options: Any) -> Lease | None:
        """:meth:`~taskguard.TaskGuard.acquire` without blocking the event loop."""
        return await self._off_loop(True, self.acquire, key, ttl, **options)

    async def atry_acquire(self, key: str, ttl: float | timedelta, **options: Any) -> Attempt:
        """:meth:`~taskguard.TaskGuard.try_acquire` without blocking the event loop."""
        return await self._off_loop(True, self.try_acquire, key, ttl, **options)

    async def arelease(self, lease: Lease, **options: Any) -> bool:
        """:meth:`~taskguard.TaskGuard.release` without blocking the event loop."""
        return await self._off_loop(False, self.release, lease, **options)

    async def arenew(self, lease: Lease, ttl: float | timedelta | None = None) -> bool:
        """:meth:`~taskguard.TaskGuard.renew` without blocking the event loop."""
        return await self._off_loop(False, self.renew, lease, ttl)

    @asynccontextmanager
    async def alock(
        self, key: str, ttl: float | timedelta, **holder_details: Any
    ) -> AsyncIterator[Lease]:
        """``async with guard.alock(key, ttl) as lease:``, as :meth:`~taskguard.TaskGuard.lock`
        (raises :class:`LockHeld`; releases on exit; does not renew)."""
        lease, holder = await self.atry_acquire(key, ttl, **holder_details)
        if lease is None:
            raise LockHeld(normalize_key(key), holder)
        try:
            yield lease
        finally:
            if not await self.arelease(lease):
                late = "lease on %r (owner %s) had already expired or been taken over at release"
                log.warning(late, lease.key, lease.owner)


class _Call:
    """One sync call run on a thread for a coroutine. Once the coroutine is cancelled
    (:meth:`abandon`), the call grants nothing more: not started, it does not run; a
    grant it makes is given back on its thread; a grant it made before is the
    coroutine's to give back (:meth:`abandon` returns it)."""

    def __init__(self, release: Callable[..., bool] | None) -> None:
        self._release = release  # None: the call grants nothing
        self._abandoned = threading.Event()
        self._lock = threading.Lock()
        self._granted: Lease | None = None

    def __call__(self, sync: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._release is not None and self._abandoned.is_set():
            return None
        abandoned.set(self._abandoned)  # this call's own context: a wait= stops at it
        result = sync(*args, **kwargs)
        lease = result.lease if isinstance(result, Attempt) else result
        with self._lock:
            orphan = self._abandoned.is_set()
            if isinstance(lease, Lease) and not orphan:
                self._granted = lease
        if isinstance(lease, Lease) and orphan:
            self.give_back(lease)
        return result

    def abandon(self) -> Lease | None:
        """The caller has gone: a grant made from now on is given back here; the grant
        made before, if any, is returned."""
        with self._lock:
            self._abandoned.set()
            return self._granted

    def give_back(self, lease: Lease) -> None:
        assert self._release is not None
        try:
            self._release(lease, reason="its asyncio call was cancelled")
        except TaskGuardError as exc:
            log.warning("lease on %r of a cancelled call not given back: %s", lease.key, exc)
