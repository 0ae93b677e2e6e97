"""The programmatic API: :class:`TaskGuard`. The CLI and the Celery glue are
thin layers over it.

This module holds the lease operations (the hot path); inspection, the reaper
and history live in :mod:`taskguard.operations`, waiting in
:mod:`taskguard.waiting`, fencing in :mod:`taskguard.fencing`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import URL, Engine
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from taskguard import history as _history
from taskguard._db import Executor
from taskguard.exceptions import (
    ConfigurationError,
    DatabaseUnavailable,
    LockHeld,
    OutcomeUnknown,
    SchemaMissing,
)
from taskguard.fencing import fence
from taskguard.keys import normalize_key, validate_holder, validate_ttl
from taskguard.lease import Lease, LockInfo
from taskguard.operations import DEFAULT_HISTORY_RETENTION, GuardOperations, ReapResult
from taskguard.waiting import wait_for

__all__ = ["MAX_LIMIT", "ReapResult", "TaskGuard"]

log = logging.getLogger("taskguard")

_HOSTNAME = socket.gethostname()
#: Largest concurrency limit: each acquire looks at up to this many slot rows.
MAX_LIMIT = 1000


def _limit(limit: object, slot: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(f"limit must be an int from 1 to {MAX_LIMIT}, got {limit!r}")
    if limit > 1 and slot != 0:
        raise ConfigurationError("pass either limit= (any free slot) or slot=, not both")
    return limit


def _wait(wait: object) -> float:
    if wait is None or wait == 0:
        return 0.0
    return validate_ttl(wait, name="wait")


class TaskGuard(GuardOperations):
    """Per-key leases stored in ``task_locks``.

    ``url_or_engine`` is a SQLAlchemy URL (taskguard creates and owns a small
    autocommit engine) or an existing :class:`~sqlalchemy.Engine` (taskguard
    borrows its pool, one statement at a time, never joining a transaction).

    Every lease operation is one short statement (two at most under a concurrency
    limit) judged by the database clock, and is safe to call from several threads;
    only ``acquire(..., wait=...)`` blocks, and only up to its timeout.

    ``durable=False`` (PostgreSQL, own engine only) trades crash durability of
    recent grants for speed; see docs/reliability.md before using it.
    ``history=True`` records every grant, conflict, release and loss in
    ``task_lock_events`` (one extra statement per operation; see
    ``taskguard explain``); the reaper trims it to ``history_retention`` seconds.
    Extra keyword arguments go to :func:`sqlalchemy.create_engine`.
    """

    def __init__(
        self,
        url_or_engine: str | URL | Engine,
        *,
        hostname: str | None = None,
        durable: bool = True,
        history: bool = False,
        history_retention: float | timedelta = DEFAULT_HISTORY_RETENTION,
        **engine_kwargs: Any,
    ) -> None:
        self._db = Executor(url_or_engine, durable=durable, **engine_kwargs)
        self.durable = durable
        self._sql = self._db.sql
        self.hostname = hostname or _HOSTNAME
        self.history = bool(history)
        self.history_retention = validate_ttl(history_retention, name="history_retention")

    # -- introspection -------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine lock statements run on."""
        return self._db.engine

    @property
    def url(self) -> str:
        """The database URL with the password masked."""
        return self._db.url

    def __repr__(self) -> str:
        return f"TaskGuard({self.url!r})"

    # -- leases ----------------------------------------------------------------------

    def acquire(
        self,
        key: str,
        ttl: float | timedelta,
        *,
        task_name: str | None = None,
        task_id: str | None = None,
        hostname: str | None = None,
        pid: int | None = None,
        slot: int = 0,
        limit: int = 1,
        min_hold: float | timedelta | None = None,
        wait: float | timedelta | None = None,
    ) -> Lease | None:
        """Take ``key`` for ``ttl`` seconds if it is free or its lease expired.

        Returns ``None`` (and logs the holder) when the key is held. One
        ``INSERT … ON CONFLICT DO UPDATE … WHERE expired`` statement. Holder details
        are for people reading the table; ownership is the random ``owner`` on the
        returned :class:`Lease`.

        * ``limit=N``: at most N holders at once, one row (slot) each; the lease
          says which ``slot`` it got. Use the same N everywhere for a key.
        * ``min_hold=S``: throttle window. The key stays taken until at least S
          seconds after this grant, even after release or a crash (at most one run
          per window). Renewals keep the window too.
        * ``wait=T``: if the key is held, wait up to T seconds for it (woken by the
          release on PostgreSQL, polling on SQLite; the longest waiter goes first).
          Without it, ``acquire`` never blocks.
        """
        key = normalize_key(key)
        seconds = validate_ttl(ttl)
        validate_holder(task_name, task_id, hostname, pid, slot)
        if limit != 1 or min_hold is not None or wait is not None or type(limit) is not int:
            return self._acquire_ext(
                key, seconds, _limit(limit, slot), min_hold, _wait(wait), slot,
                task_name, task_id, hostname, pid,
            )  # fmt: skip
        owner = uuid.uuid4().hex
        values = {
            "key": key,
            "slot": slot,
            "owner": owner,
            "ttl": self._sql.seconds_param(seconds),
            "task_name": task_name,
            "task_id": task_id,
            "hostname": hostname if hostname is not None else self.hostname,
            "pid": pid if pid is not None else os.getpid(),
        }
        lease = self._try(key, values, 1, seconds, 0.0)
        if lease is None:
            self._conflict(key, values)
        elif self.history:
            _history.record_acquired(self, lease, values, None)
        return lease

    def _acquire_ext(
        self,
        key: str,
        seconds: float,
        limit: int,
        min_hold: float | timedelta | None,
        wait: float,
        slot: int,
        task_name: str | None,
        task_id: str | None,
        hostname: str | None,
        pid: int | None,
    ) -> Lease | None:
        """acquire() with a concurrency limit, a throttle window or waiting."""
        hold = 0.0 if min_hold is None or min_hold == 0 else validate_ttl(min_hold, name="min_hold")
        values = {
            "key": key,
            "slot": slot,
            "n": limit,
            "owner": uuid.uuid4().hex,  # one owner for every attempt: the queue knows it
            # The row itself keeps the window: a crashed holder frees it no earlier.
            "ttl": self._sql.seconds_param(max(seconds, hold)),
            "task_name": task_name,
            "task_id": task_id,
            "hostname": hostname if hostname is not None else self.hostname,
            "pid": pid if pid is not None else os.getpid(),
        }
        lease = self._try(key, values, limit, seconds, hold)
        waited = None
        if lease is None and wait > 0:
            started = time.monotonic()
            holder = self._current_holder(key)
            log.info(
                "lock %r is held by %s; waiting up to %gs",
                key,
                holder.describe() if holder else "a holder that just released",
                wait,
            )
            lease = wait_for(
                self,
                lambda: self._try(key, values, limit, seconds, hold),
                key,
                values["owner"],
                range(slot, slot + 1) if limit == 1 else range(limit),
                wait,
            )
            waited = time.monotonic() - started
        if lease is None:
            self._conflict(key, values, waited)
        elif self.history:
            _history.record_acquired(self, lease, values, waited)
        return lease

    def _try(
        self, key: str, values: dict[str, Any], limit: int, seconds: float, hold: float
    ) -> Lease | None:
        """One grant attempt (two statements at most); ``None`` if the key is held."""
        stmt = self._sql.acquire if limit == 1 else self._sql.acquire_slots
        try:
            rows, _ = self._db.run(stmt, values)
        except (SchemaMissing, OutcomeUnknown):
            raise
        except DatabaseUnavailable as exc:
            if not exc.statement_sent:
                raise  # nothing reached the server: certainly not granted
            # The grant may have committed before the connection broke. Never assume:
            # read back by owner, which is unique to this attempt.
            recovered = self._recover(key, None if limit > 1 else values["slot"], values, exc)
            if recovered is not None:
                recovered.ttl, recovered.min_hold = seconds, hold
                return recovered
            try:
                rows, _ = self._db.run(stmt, values)
            except DatabaseUnavailable as again:
                if not again.statement_sent:
                    raise
                raise OutcomeUnknown(
                    f"connection to {self.url} broke again while retrying the acquire of "
                    f"{key!r}; owner {values['owner']} may hold it until its ttl ends",
                    key,
                    values["owner"],
                    self.url,
                ) from again
        if limit > 1:
            if rows and rows[0][1] is None:
                # Lost the race for a new slot to a concurrent acquirer: one more try
                # (that slot now exists; the retry takes another or finds all taken).
                rows, _ = self._db.run(stmt, values)
            if not rows or rows[0][1] is None:
                return None
            slot, token, acquired_at, expires_at = rows[0]
        elif rows:
            slot = values["slot"]
            token, acquired_at, expires_at = rows[0]
        else:
            return None
        return Lease(
            key=key,
            owner=values["owner"],
            token=int(token),
            acquired_at=self._sql.to_datetime(acquired_at),
            expires_at=self._sql.to_datetime(expires_at),
            ttl=seconds,
            slot=int(slot),
            min_hold=hold,
        )

    def _recover(
        self, key: str, slot: int | None, values: dict[str, Any], cause: DatabaseUnavailable
    ) -> Lease | None:
        owner = values["owner"]
        try:
            if slot is None:
                rows = self._rows(self._sql.get, {"key": key})
                info = next((r for r in rows if r.owner == owner), None)
            else:
                info = self._read_owner(key, slot, owner)
        except DatabaseUnavailable:
            raise OutcomeUnknown(
                f"connection to {self.url} broke while acquiring {key!r} and the outcome "
                f"could not be read back; owner {owner} may hold it until its ttl ends",
                key,
                owner,
                self.url,
            ) from cause
        if info is not None and info.held:
            log.warning("acquire of %r committed before the connection broke; keeping it", key)
            return Lease(key, owner, info.token, info.acquired_at, info.expires_at, 0.0, info.slot)
        log.warning("acquire of %r did not take effect before the connection broke; retrying", key)
        return None

    def release(self, lease: Lease) -> bool:
        """Give the lease back. ``True`` if this call ended it; ``False`` if it had
        already expired or been taken over (a stale owner never touches another's row).
        Under a throttle window (``min_hold``) the key stays taken until the window ends."""
        values: dict[str, Any] = {"key": lease.key, "slot": lease.slot, "owner": lease.owner}
        stmt = self._sql.release
        if lease.min_hold:
            stmt = self._sql.release_hold
            values["hold"] = self._sql.seconds_param(lease.min_hold)
        try:
            _, count = self._db.run(stmt, values)
        except DatabaseUnavailable as exc:
            if not exc.statement_sent:
                raise
            info = self._reread_or_unknown(lease, "releasing", exc)
            if info is None or info.owner != lease.owner:
                return False
            if not info.held:
                # Still our row but ended before its expiry: our release committed and
                # only the reply was lost. Ended at or after it: it had expired.
                return info.expires_at < lease.expires_at
            _, count = self._db.run(stmt, values)
        if self.history:
            self._record_end(lease, "released" if count == 1 else "lost", "at release")
        return count == 1

    def renew(self, lease: Lease, ttl: float | timedelta | None = None) -> bool:
        """Extend the lease to ``ttl`` (default: its original ttl) from now, by the
        database clock. Updates ``lease.expires_at``. ``False`` if it is no longer ours."""
        seconds = lease.ttl if ttl is None else validate_ttl(ttl)
        values = {
            "key": lease.key,
            "slot": lease.slot,
            "owner": lease.owner,
            "ttl": self._sql.seconds_param(seconds),
        }
        stmt = self._sql.renew
        if lease.min_hold:
            stmt = self._sql.renew_hold
            values["hold"] = self._sql.seconds_param(lease.min_hold)
        try:
            rows, _ = self._db.run(stmt, values)
        except DatabaseUnavailable as exc:
            if not exc.statement_sent:
                raise
            info = self._reread_or_unknown(lease, "renewing", exc)
            if info is None or info.owner != lease.owner or not info.held:
                return False
            rows, _ = self._db.run(stmt, values)
        if not rows:
            if self.history:
                self._record_end(lease, "lost", "at renewal")
            return False
        lease.expires_at = self._sql.to_datetime(rows[0][2])
        lease.ttl = seconds
        return True

    def adopt(
        self,
        key: str,
        owner: str,
        ttl: float | timedelta,
        *,
        slot: int = 0,
        min_hold: float | timedelta | None = None,
    ) -> Lease | None:
        """Take over a live lease by its owner id (e.g. one a publisher acquired and
        handed to the worker in the message), renewing it to ``ttl``; pass the
        lease's ``min_hold`` to keep its throttle window.
        ``None`` if that owner no longer holds the key."""
        key = normalize_key(key)
        seconds = validate_ttl(ttl)
        hold = 0.0 if min_hold is None or min_hold == 0 else validate_ttl(min_hold, name="min_hold")
        values = {"key": key, "slot": slot, "owner": owner, "ttl": self._sql.seconds_param(seconds)}
        stmt = self._sql.renew
        if hold:
            stmt = self._sql.renew_hold
            values["hold"] = self._sql.seconds_param(hold)
        rows, _ = self._db.run(stmt, values)
        if not rows:
            return None
        token, acquired_at, expires_at = rows[0]
        return Lease(
            key,
            owner,
            int(token),
            self._sql.to_datetime(acquired_at),
            self._sql.to_datetime(expires_at),
            seconds,
            slot,
            hold,
        )

    def fence(self, lease: Lease, session: Session | Connection) -> int:
        """:meth:`Lease.fence`: check ``lease`` inside ``session``'s transaction and
        return its token; raises :class:`~taskguard.LeaseLost` if it is not held."""
        return fence(lease, session)

    def _reread_or_unknown(
        self, lease: Lease, doing: str, cause: DatabaseUnavailable
    ) -> LockInfo | None:
        try:
            return self._read_owner(lease.key, lease.slot, lease.owner)
        except DatabaseUnavailable:
            raise OutcomeUnknown(
                f"connection to {self.url} broke while {doing} {lease.key!r}; "
                f"outcome unknown (lease expires by {lease.expires_at.isoformat()} at the latest)",
                lease.key,
                lease.owner,
                self.url,
            ) from cause

    @contextmanager
    def lock(self, key: str, ttl: float | timedelta, **holder_details: Any) -> Iterator[Lease]:
        """``with guard.lock(key, ttl) as lease:`` — raises :class:`LockHeld` (with
        the current holder) if the key is taken; releases on exit. It does not renew:
        keep the body shorter than ``ttl`` or call :meth:`renew`."""
        lease = self.acquire(key, ttl, **holder_details)
        if lease is None:
            key = normalize_key(key)
            raise LockHeld(key, self._current_holder(key))
        try:
            yield lease
        finally:
            if not self.release(lease):
                log.warning(
                    "lease on %r (owner %s) had already expired or been taken over at release",
                    lease.key,
                    lease.owner,
                )
