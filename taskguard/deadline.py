"""A client-side time limit for every lock statement: no call hangs.

Server-side timeouts cannot bound everything: a commit waiting for a synchronous
standby ignores ``statement_timeout``, and cancelling that wait makes PostgreSQL
keep the commit locally and answer *success* (docs/reliability.md, "Which
PostgreSQL topologies ..."). So the limit here never cancels: when a statement
outlives its deadline, one watchdog thread per process shuts the statement's
socket down. The driver then fails at once with a broken connection, the pool
drops it, and the caller reports the outcome as unknown (acquire, renew) or the
database as unavailable - it never reports a success it has not seen.

:func:`call_limit` narrows the deadline for everything run inside it on this
thread (or asyncio task): the renewer uses it to give up on a renewal before the
lease would expire by the local clock.
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_STATEMENT_LIMIT",
    "Watch",
    "call_limit",
    "current_deadline",
    "watchdog",
]

#: Seconds any one statement may take when no tighter limit is in force (a backstop
#: for reads, reaper batches and the CLI; lease operations use the call timeout).
DEFAULT_STATEMENT_LIMIT = 30.0
#: Seconds one lease operation (acquire attempt, renew, release, with the read-back
#: after a broken connection) may take: the ``call_timeout`` of TaskGuard.
DEFAULT_CALL_TIMEOUT = 10.0

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "taskguard_deadline", default=None
)


def current_deadline() -> float | None:
    """The ``time.monotonic()`` by which calls in this context must end, if any."""
    return _DEADLINE.get()


@contextlib.contextmanager
def call_limit(seconds: float) -> Iterator[float]:
    """Everything taskguard runs inside this block ends within ``seconds`` (or as
    OutcomeUnknown / DatabaseUnavailable). Nested limits only ever shorten it."""
    deadline = time.monotonic() + max(0.0, seconds)
    outer = _DEADLINE.get()
    if outer is not None:
        deadline = min(deadline, outer)
    token = _DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _DEADLINE.reset(token)


class Watch:
    """One statement being watched; ``fired`` once its socket was shut down."""

    __slots__ = ("deadline", "done", "fd", "fired")

    def __init__(self, deadline: float, fd: int) -> None:
        self.deadline = deadline
        self.fd = fd
        self.done = False
        self.fired = False


class _Watchdog:
    """One daemon thread per process, sleeping until the earliest deadline."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Watch]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, fd: int | None, limit: float | None = None) -> Iterator[Watch | None]:
        """Shut ``fd`` down if the block outlives ``limit`` seconds or the context's
        deadline, whichever is sooner. ``fd=None``: nothing to watch (SQLite)."""
        deadline = time.monotonic() + (DEFAULT_STATEMENT_LIMIT if limit is None else limit)
        outer = _DEADLINE.get()
        if outer is not None:
            deadline = min(deadline, outer)
        if fd is None or fd < 0:
            yield None
            return
        w = Watch(deadline, fd)
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), w))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="taskguard-watchdog", daemon=True
                )
                self._thread.start()
            elif self._heap[0][2] is w:
                self._cond.notify()
        try:
            yield w
        finally:
            with self._cond:
                # Under the lock: the thread never shuts a socket down after we left,
                # when the fd may already belong to another connection.
                w.done = True

    def _loop(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    if not self._cond.wait(5.0) and not self._heap:
                        self._thread = None
                        return
                    continue
                deadline, _, w = self._heap[0]
                now = time.monotonic()
                if deadline > now:
                    self._cond.wait(deadline - now)
                    continue
                heapq.heappop(self._heap)
                w.fired = True
                _shut_down(w.fd)


def _shut_down(fd: int) -> None:
    # shutdown() acts on the connection, not the descriptor: a dup is enough, and the
    # driver's own descriptor stays valid (it just sees the connection end).
    with contextlib.suppress(OSError):
        dup = os.dup(fd)
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            raise
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


#: The process's watchdog; its thread starts with the first watched statement.
watchdog = _Watchdog()

if hasattr(os, "register_at_fork"):
    # The thread does not survive a fork and its lock may have been held.
    os.register_at_fork(after_in_child=watchdog.reset)
