"""The worker main process's lease thread (see :mod:`taskguard.celery.prefetched`).

It sends every statement the main process makes for prefetched messages, so the
worker's event loop never waits on the database: the batches of grants the loop
hands to it (one durable statement each) and the grants the loop gives back
(messages revoked before they started, the worker stopping). Outcomes go back to
the loop through a pipe, and the loop dispatches the requests (Celery's
structures belong to the loop's thread).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from taskguard.config import guard_for
from taskguard.lease import Lease, LeaseRequest

__all__ = ["Granted", "Leaser"]

log = logging.getLogger("taskguard.celery")

#: A batch of grants: the loop's opaque items and their requests.
GrantBatch = tuple[list[Any], list[LeaseRequest]]
#: Its outcome: the items, a lease or None each, and when the statement was sent
#: (time.monotonic(), the grant's age is measured from there).
Granted = tuple[list[Any], list[Lease | None], float]


class Leaser(threading.Thread):
    """One per worker main process, started by the batcher on the loop's thread;
    ``deliver`` is called on that thread with each :data:`Granted`."""

    def __init__(self, app: Any, hub: Any, deliver: Callable[[Granted], None]) -> None:
        super().__init__(name="taskguard-leaser", daemon=True)
        self.app = app
        self._deliver = deliver
        self._grants: deque[GrantBatch] = deque()
        self._gives: deque[Lease] = deque()
        self._done: deque[Granted] = deque()
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        self._done_r, self._done_w = os.pipe()
        for fd in (self._wake_r, self._wake_w, self._done_r, self._done_w):
            os.set_blocking(fd, False)
        hub.add_reader(self._done_r, self._on_done)

    # -- called on the loop's thread ---------------------------------------------------

    def grant(self, items: list[Any], requests: list[LeaseRequest]) -> None:
        self._grants.append((items, requests))
        self._poke(self._wake_w)

    def give_back(self, lease: Lease) -> None:
        self._gives.append(lease)
        self._poke(self._wake_w)

    def _on_done(self) -> None:
        _drain(self._done_r)
        while self._done:
            self._deliver(self._done.popleft())

    def stop(self, timeout: float = 10.0) -> None:
        """Finish what was handed over and stop."""
        self._stopping = True
        self._poke(self._wake_w)
        self.join(timeout)

    # -- the thread ------------------------------------------------------------------------

    def run(self) -> None:
        while True:
            try:
                select.select([self._wake_r], [], [], 1.0)
            except OSError:
                return
            _drain(self._wake_r)
            self._turn()
            if self._stopping:
                self._turn()  # what arrived while the last turn ran
                return

    def _turn(self) -> None:
        guard = guard_for(self.app)
        # Grants first: pool processes may be waiting for them.
        while self._grants:
            items, requests = self._grants.popleft()
            sent = time.monotonic()
            try:
                leases = guard.acquire_many(requests)
            except Exception as exc:  # the pool processes acquire themselves
                log.warning("could not take the leases of %d prefetched tasks: %s", len(items), exc)
                leases = [None] * len(items)
            self._done.append((items, leases, sent))
            self._poke(self._done_w)
        gives = [self._gives.popleft() for _ in range(len(self._gives))]
        if gives:
            self._give_back(guard, gives)

    def _give_back(self, guard: Any, leases: list[Lease]) -> None:
        try:
            released = guard.release_many([(lease, None) for lease in leases])
        except Exception as exc:
            released = [False] * len(leases)
            log.error(
                "could not give back %d unstarted grants (they end by expiry): %s", len(leases), exc
            )
        for lease, done in zip(leases, released, strict=True):
            log.info(
                "gave back lock %r of a prefetched task that never started: %s", lease.key, done
            )

    @staticmethod
    def _poke(fd: int) -> None:
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            os.write(fd, b"\0")


def _drain(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)
