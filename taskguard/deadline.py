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
lease would expire by the local clock. Opening a connection has no socket to shut
down yet: :func:`within` runs it on a helper thread that the caller stops waiting
for at the deadline.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, cast

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_STATEMENT_LIMIT",
    "Watch",
    "bounded",
    "call_limit",
    "current_deadline",
    "watchdog",
    "within",
]

#: Seconds any one statement may take when no tighter limit is in force (a backstop
#: for reads, reaper batches and the CLI; lease operations use the call timeout).
DEFAULT_STATEMENT_LIMIT = 30.0
#: Seconds one lease operation (acquire attempt, renew, release, with the read-back
#: after a broken connection) may take: the ``call_timeout`` of TaskGuard.
DEFAULT_CALL_TIMEOUT = 10.0
#: Seconds the watchdog thread lingers with nothing to watch before it exits.
_IDLE_EXIT = 5.0

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "taskguard_deadline", default=None
)


def current_deadline() -> float | None:
    """The ``time.monotonic()`` by which calls in this context must end, if any."""
    return _DEADLINE.get()


def push_limit(seconds: float) -> contextvars.Token[float | None]:
    """Narrow this context's deadline to ``seconds`` from now (never widen it);
    undo with :func:`pop_limit`. :func:`call_limit` without a generator, for the
    storage layer's per-call path."""
    deadline = time.monotonic() + max(0.0, seconds)
    outer = _DEADLINE.get()
    if outer is not None and outer < deadline:
        deadline = outer
    return _DEADLINE.set(deadline)


def pop_limit(token: contextvars.Token[float | None]) -> None:
    """Restore the deadline :func:`push_limit` replaced."""
    _DEADLINE.reset(token)


_F = TypeVar("_F", bound=Callable[..., Any])


def bounded(method: _F) -> _F:
    """Run a lease operation (statement, read-back, retry) within its object's
    ``call_timeout``: past it the socket is shut down, never the statement cancelled,
    and the caller gets OutcomeUnknown / DatabaseUnavailable."""

    @functools.wraps(method)
    def within_limit(self: Any, *args: Any, **kwargs: Any) -> Any:
        # push_limit(), inline: this runs for every lease operation.
        deadline = min(time.monotonic() + self.call_timeout, _DEADLINE.get() or math.inf)
        token = _DEADLINE.set(deadline)
        try:
            return method(self, *args, **kwargs)
        finally:
            _DEADLINE.reset(token)

    return cast(_F, within_limit)


@contextlib.contextmanager
def call_limit(seconds: float) -> Iterator[float]:
    """Everything taskguard runs inside this block ends within ``seconds`` (or as
    OutcomeUnknown / DatabaseUnavailable). Nested limits only ever shorten it."""
    token = push_limit(seconds)
    try:
        yield _DEADLINE.get() or 0.0
    finally:
        pop_limit(token)


class Watch:
    """One socket being watched: shut down once ``deadline`` passes (``math.inf``:
    not armed); ``fired`` once it was."""

    __slots__ = ("deadline", "fd", "fired")

    def __init__(self, deadline: float, fd: int) -> None:
        self.deadline = deadline
        self.fd = fd
        self.fired = False


class _Watchdog:
    """One daemon thread per process, sleeping until the earliest deadline.

    Watches are few (a connection's, kept while a thread pins it, armed per
    statement; or one per statement on a borrowed connection), so they are kept in
    a dict and the thread scans it when it wakes. Arming a kept watch writes its
    deadline and wakes the thread only when that deadline is earlier than the one
    the thread sleeps towards (rare: limits are seconds, statements milliseconds):
    two attribute writes per statement, no lock. While it scans, the thread counts
    as sleeping towards -inf, so an arm it might have missed wakes it again.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        # The callers' side takes the plain lock (no Python-level Condition.__enter__);
        # the condition over it wakes the thread.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active: dict[int, Watch] = {}
        #: When the sleeping thread looks again (math.inf: no thread).
        self.wake_at = math.inf
        self._thread: threading.Thread | None = None

    def start(self, fd: int | None, limit: float | None = None) -> Watch | None:
        """Shut ``fd`` down if :meth:`stop` is not called within ``limit`` seconds
        (default :data:`DEFAULT_STATEMENT_LIMIT`) or by the context's deadline,
        whichever is sooner. ``fd=None``: nothing to watch (SQLite)."""
        if fd is None or fd < 0:
            return None
        seconds = DEFAULT_STATEMENT_LIMIT if limit is None else limit
        return self._add(Watch(min(time.monotonic() + seconds, _DEADLINE.get() or math.inf), fd))

    def keep(self, fd: int | None) -> Watch:
        """A watch for a connection's socket, unarmed. Arm it per statement by setting
        its ``deadline`` (and :meth:`poke` the thread when that is before
        :attr:`wake_at`), disarm it by setting ``math.inf``; :meth:`stop` it before the
        connection closes. ``fd=None`` (no socket, e.g. SQLite): one never watched."""
        return Watch(math.inf, -1) if fd is None or fd < 0 else self._add(Watch(math.inf, fd))

    def _add(self, w: Watch) -> Watch:
        with self._lock:
            self._active[id(w)] = w
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="taskguard-watchdog", daemon=True
                )
                self._thread.start()
            elif w.deadline < self.wake_at:
                self._cond.notify()
        return w

    def poke(self) -> None:
        """Make the thread look at the deadlines again now (if it runs)."""
        if self._thread is None:
            return  # nothing watched (a watch added starts it)
        with self._lock:
            self._cond.notify()

    def stop(self, w: Watch | None) -> None:
        """The statement (or the kept connection) ended: never shut its socket down
        after this."""
        if w is not None and w.fd >= 0:  # else never watched (keep(None))
            # Under the lock: the thread never shuts a socket down after we left, when
            # the fd may already belong to another connection.
            with self._lock:
                self._active.pop(id(w), None)

    @contextlib.contextmanager
    def watch(self, fd: int | None, limit: float | None = None) -> Iterator[Watch | None]:
        """:meth:`start` and :meth:`stop` around a block."""
        w = self.start(fd, limit)
        try:
            yield w
        finally:
            self.stop(w)

    def _loop(self) -> None:
        with self._cond:
            idle_since: float | None = None
            while True:
                self.wake_at = -math.inf  # an arm during the scan wakes us again
                now = time.monotonic()
                earliest = math.inf
                for key, w in list(self._active.items()):
                    if w.deadline <= now:
                        del self._active[key]
                        w.fired = True
                        _shut_down(w.fd)
                    elif w.deadline < earliest:
                        earliest = w.deadline
                if self._active:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since >= _IDLE_EXIT:
                    self._thread = None
                    self.wake_at = math.inf
                    return
                self.wake_at = min(earliest, now + _IDLE_EXIT)
                self._cond.wait(self.wake_at - now)


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


_T = TypeVar("_T")


class _Helper(Generic[_T]):
    """One call on a helper thread; a result that comes after its caller stopped
    waiting is handed to ``discard``."""

    def __init__(self, work: Callable[[], _T], discard: Callable[[_T], None]) -> None:
        self._work = work
        self._discard = discard
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._result: _T | None = None
        self._error: BaseException | None = None
        self._abandoned = False

    def run(self) -> None:
        try:
            result = self._work()
        except BaseException as exc:  # raised in the waiting caller
            self._error = exc
        else:
            with self._lock:
                late = self._abandoned
                if not late:
                    self._result = result
            if late:
                self._discard(result)
        finally:
            self._done.set()

    def wait(self, seconds: float) -> _T | None:
        if not self._done.wait(seconds):
            with self._lock:
                if self._result is None:
                    self._abandoned = True
                    return None
        if self._error is not None:
            raise self._error
        return self._result


def within(work: Callable[[], _T], seconds: float, discard: Callable[[_T], None]) -> _T | None:
    """``work()`` run on a helper thread, waited for at most ``seconds``: its result
    (its error is raised here), or ``None`` if it did not end in time; a result that
    comes later goes to ``discard``. For blocking calls with no socket to watch
    (opening a connection): the caller's deadline holds, the call itself ends on its
    own (give it a timeout of its own, so abandoned threads do not pile up)."""
    helper = _Helper(work, discard)
    threading.Thread(target=helper.run, name="taskguard-helper", daemon=True).start()
    return helper.wait(seconds)
