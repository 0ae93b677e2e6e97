"""Locking off: a stand-in guard that grants every lock without a database.

For tests (see :mod:`taskguard.testing`): ``TASKGUARD_LOCKING=off`` in the
environment, :func:`locking_disabled` for a block. While it is off every acquire is
granted at once (guarded tasks always run; nothing is skipped, retried or made to
wait), fences of those leases pass, and taskguard logs once per process, at
WARNING, on the first lock it did not take, that locking is off.

:func:`locking_off_requested` is the one place the switch is read.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

from taskguard import config
from taskguard.guard import ReapResult, TaskGuard
from taskguard.lease import Attempt, Lease, LockInfo
from taskguard.validation import new_owner

__all__ = ["NoLockGuard", "apply_environment", "locking_disabled", "locking_off_requested"]

log = logging.getLogger("taskguard")

#: Environment variable that turns locking off for a whole process (``off``).
LOCKING_ENV = "TASKGUARD_LOCKING"
_OFF_WORDS = frozenset({"off", "0", "false", "no", "disabled"})


class UnlockedLease(Lease):
    """A lease granted while locking is off: its fence passes without a database."""

    __slots__ = ()

    def fence(self, session: Any) -> int:
        """Always passes (locking is off); returns the token."""
        return self.token


class NoLockGuard:
    """Stands in for :class:`~taskguard.TaskGuard` while locking is off: grants
    everything, holds nothing, runs no SQL."""

    url = "taskguard://locking-off"
    dialect_name = "none"
    history = False

    def __init__(self) -> None:
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()

    def _lease(self, key: str, ttl: float | timedelta, slot: int = 0, owner: str = "") -> Lease:
        _log_off_once()
        seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else float(ttl)
        now = datetime.now(timezone.utc)
        with self._lock:
            token = next(self._tokens)
        return UnlockedLease(
            key=key,
            owner=owner or new_owner(),
            token=token,
            acquired_at=now,
            expires_at=now + timedelta(seconds=seconds),
            ttl=seconds,
            slot=slot,
        )

    def acquire(self, key: str, ttl: float | timedelta, **_: Any) -> Lease:
        """Granted at once."""
        return self._lease(key, ttl)

    def try_acquire(self, key: str, ttl: float | timedelta, **_: Any) -> Attempt:
        """Granted at once; nobody is ever in the way."""
        return Attempt(self._lease(key, ttl), None)

    def take(self, key: str, seconds: float, *_: Any, **__: Any) -> Attempt:
        """Granted at once (an integration's run)."""
        return Attempt(self._lease(key, seconds), None)

    def give_back(self, lease: Lease, *_: Any) -> bool:
        """Nothing to give back."""
        return True

    def adopt(self, key: str, owner: str, ttl: float | timedelta, **kw: Any) -> Lease:
        """The handed-over lease, always still held."""
        return self._lease(key, ttl, int(kw.get("slot", 0)), owner)

    def release(self, lease: Lease, *, marker: Any = None, reason: Any = None) -> bool:
        """Nothing to give back; a ``marker`` is not kept (nothing is ever refused)."""
        return True

    def record_event(self, key: str, event: str, detail: str, **holder: Any) -> None:
        """No history without locks."""

    def renew(self, lease: Lease, ttl: float | timedelta | None = None) -> bool:
        return True

    def is_held_by(self, lease: Lease) -> bool:
        return True

    def fence(self, lease: Lease, session: Any = None) -> int:
        return lease.token

    def get(self, key: str) -> LockInfo | None:
        return None

    def get_all(self, key: str) -> list[LockInfo]:
        return []

    def held(self, *args: Any, **kwargs: Any) -> list[LockInfo]:
        return []

    def force_release(self, key: str) -> bool:
        return False

    def reap(self, **_: Any) -> ReapResult:
        return ReapResult(0, 0)

    def db_now(self) -> datetime:
        return datetime.now(timezone.utc)

    def dispose(self) -> None:
        pass

    @contextlib.contextmanager
    def lock(self, key: str, ttl: float | timedelta, **_: Any) -> Iterator[Lease]:
        yield self._lease(key, ttl)


_off_lock = threading.Lock()
_off_depth: list[Callable[[Any], TaskGuard]] = []
_logged_off: list[bool] = []


def _log_off_once() -> None:
    if not _logged_off:
        _logged_off.append(True)
        log.warning(
            "taskguard: locking is OFF (taskguard.testing): every lock is granted at once "
            "and nothing is written to a lock database"
        )


@contextlib.contextmanager
def locking_disabled() -> Iterator[NoLockGuard]:
    """Turn locking off inside the block: every guarded task's guard (the one
    :func:`taskguard.config.guard_for` hands out) is a :class:`NoLockGuard`."""
    guard = NoLockGuard()
    with _off_lock:
        # guard_for() resolves every app's guard through config._resolve: the one
        # place to swap without a hook in taskguard.config.
        _off_depth.append(config._resolve)
        config._resolve = lambda app, url=None: guard  # type: ignore[assignment,return-value]
        config.reset_guards()
    try:
        yield guard
    finally:
        with _off_lock:
            config._resolve = _off_depth.pop()  # type: ignore[assignment]
            config.reset_guards()


def locking_off_requested(ini_value: str | None = None) -> bool:
    """Whether the run asked for locking off: ``$TASKGUARD_LOCKING`` (which wins)
    or the pytest ini value ``taskguard_locking``. The one place the switch is read."""
    value = os.environ.get(LOCKING_ENV) or ini_value or ""
    return value.strip().lower() in _OFF_WORDS


_process_off: list[contextlib.AbstractContextManager[NoLockGuard]] = []


def apply_environment() -> bool:
    """Turn locking off for the rest of the process if ``$TASKGUARD_LOCKING`` says
    so (the Django app calls this when it starts, e.g. under ``manage.py test``).
    Returns whether locking is now off."""
    if _process_off:
        return True
    if not locking_off_requested():
        return False
    switch = locking_disabled()
    switch.__enter__()
    _process_off.append(switch)
    return True
