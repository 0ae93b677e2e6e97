"""The lease API for asyncio, as :class:`~taskguard.TaskGuard` methods: each call runs
the sync method's (short) statement on a worker thread, so the event loop is never
blocked, not even by ``wait=``; the lease rules are the sync methods'."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from taskguard.exceptions import LockHeld
from taskguard.keys import normalize_key
from taskguard.lease import Attempt, Lease

__all__ = ["AsyncLeases"]

log = logging.getLogger("taskguard")


class AsyncLeases:
    """``aacquire``, ``atry_acquire``, ``arelease``, ``arenew`` and ``alock``."""

    # The sync API they run (TaskGuard's methods).
    acquire: Callable[..., Lease | None]
    try_acquire: Callable[..., Attempt]
    release: Callable[..., bool]
    renew: Callable[..., bool]

    async def aacquire(self, key: str, ttl: float | timedelta, **options: Any) -> Lease | None:
        """:meth:`~taskguard.TaskGuard.acquire` without blocking the event loop."""
        return await asyncio.to_thread(self.acquire, key, ttl, **options)

    async def atry_acquire(self, key: str, ttl: float | timedelta, **options: Any) -> Attempt:
        """:meth:`~taskguard.TaskGuard.try_acquire` without blocking the event loop."""
        return await asyncio.to_thread(self.try_acquire, key, ttl, **options)

    async def arelease(self, lease: Lease, **options: Any) -> bool:
        """:meth:`~taskguard.TaskGuard.release` without blocking the event loop."""
        return await asyncio.to_thread(self.release, lease, **options)

    async def arenew(self, lease: Lease, ttl: float | timedelta | None = None) -> bool:
        """:meth:`~taskguard.TaskGuard.renew` without blocking the event loop."""
        return await asyncio.to_thread(self.renew, lease, ttl)

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
