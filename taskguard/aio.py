"""The lease API for asyncio, as :class:`~taskguard.TaskGuard` methods: each call runs
the sync method's (short) statement on one of the guard's two lease threads (a call
with ``wait=`` on the loop's default executor, where it holds up no other call), so
the event loop is never blocked; the lease rules are the sync methods'.

Two threads, not ``asyncio.to_thread``'s pool (up to cores + 4): each thread busy with
a statement's Python work is one more the loop waits behind for the GIL, up to the
5 ms switch interval each time (tests/integration/test_async_guard.py, 100 coroutines
on 2 cores, Python 3.11: p99 lag about 8 ms on that pool, 3 ms on two threads).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, TypeVar

from taskguard.exceptions import LockHeld
from taskguard.keys import normalize_key
from taskguard.lease import Attempt, Lease

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

    async def _off_loop(self, sync: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        if kwargs.get("wait"):  # blocks its thread for the whole wait
            return await asyncio.to_thread(sync, *args, **kwargs)
        threads = self._lease_threads
        if threads is None or threads[0] != os.getpid():
            threads = self._lease_threads = (os.getpid(), ThreadPoolExecutor(2, "taskguard-aio"))
        call = functools.partial(contextvars.copy_context().run, sync, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(threads[1], call)

    async def aacquire(self, key: str, ttl: float | timedelta, **options: Any) -> Lease | None:
        """:meth:`~taskguard.TaskGuard.acquire` without blocking the event loop."""
        return await self._off_loop(self.acquire, key, ttl, **options)

    async def atry_acquire(self, key: str, ttl: float | timedelta, **options: Any) -> Attempt:
        """:meth:`~taskguard.TaskGuard.try_acquire` without blocking the event loop."""
        return await self._off_loop(self.try_acquire, key, ttl, **options)

    async def arelease(self, lease: Lease, **options: Any) -> bool:
        """:meth:`~taskguard.TaskGuard.release` without blocking the event loop."""
        return await self._off_loop(self.release, lease, **options)

    async def arenew(self, lease: Lease, ttl: float | timedelta | None = None) -> bool:
        """:meth:`~taskguard.TaskGuard.renew` without blocking the event loop."""
        return await self._off_loop(self.renew, lease, ttl)

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
