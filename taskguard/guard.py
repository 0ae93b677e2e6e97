"""The programmatic API: :class:`TaskGuard`. The CLI and the Celery glue are
thin layers over it."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import URL, Engine

from taskguard._db import Executor
from taskguard.exceptions import (
    DatabaseUnavailable,
    InvalidKey,
    LockHeld,
    OutcomeUnknown,
    SchemaMissing,
)
from taskguard.keys import normalize_key, validate_ttl
from taskguard.lease import Holder, Lease, LockInfo

__all__ = ["ReapResult", "TaskGuard"]

log = logging.getLogger("taskguard")

_HOSTNAME = socket.gethostname()
# Cap on rows returned by held(); an operator listing more wants SQL, not a list.
_DEFAULT_LIMIT = 10_000


class ReapResult(int):
    """Number of rows a reap removed (an ``int``), plus how many batches it took."""

    batches: int

    def __new__(cls, removed: int, batches: int) -> ReapResult:
        obj = super().__new__(cls, removed)
        obj.batches = batches
        return obj


class TaskGuard:
    """Per-key leases stored in ``task_locks``.

    ``url_or_engine`` is a SQLAlchemy URL (taskguard creates and owns a small
    autocommit engine) or an existing :class:`~sqlalchemy.Engine` (taskguard
    borrows its pool, one statement at a time, never joining a transaction).

    Every method is a single short statement judged by the database clock, and is
    safe to call from several threads.

    ``durable=False`` (PostgreSQL, own engine only) trades crash durability of
    recent grants for speed; see docs/reliability.md before using it.
    Extra keyword arguments go to :func:`sqlalchemy.create_engine`.
    """

    def __init__(
        self,
        url_or_engine: str | URL | Engine,
        *,
        hostname: str | None = None,
        durable: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        self._db = Executor(url_or_engine, durable=durable, **engine_kwargs)
        self.durable = durable
        self._sql = self._db.sql
        self.hostname = hostname or _HOSTNAME

    # -- introspection -------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine lock statements run on."""
        return self._db.engine

    @property
    def url(self) -> str:
        """The database URL with the password masked."""
        return self._db.url

    @property
    def dialect_name(self) -> str:
        return self._sql.dialect_name

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
    ) -> Lease | None:
        """Take ``key`` for ``ttl`` seconds if it is free or its lease expired.

        Never blocks on a held key: returns ``None`` (and logs the holder) when the
        key is held. One ``INSERT … ON CONFLICT DO UPDATE … WHERE expired`` statement.
        Holder details are for people reading the table; ownership is the random
        ``owner`` on the returned :class:`Lease`.
        """
        key = normalize_key(key)
        seconds = validate_ttl(ttl)
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
        try:
            rows, _ = self._db.run(self._sql.acquire, values)
        except (SchemaMissing, OutcomeUnknown):
            raise
        except DatabaseUnavailable as exc:
            # The grant may have committed before the connection broke. Never assume:
            # read back by owner, which is unique to this attempt.
            recovered = self._recover(key, slot, owner, seconds, exc)
            if recovered is not None:
                return recovered
            rows, _ = self._db.run(self._sql.acquire, values)
        if rows:
            token, acquired_at, expires_at = rows[0]
            return Lease(
                key=key,
                owner=owner,
                token=int(token),
                acquired_at=self._sql.to_datetime(acquired_at),
                expires_at=self._sql.to_datetime(expires_at),
                ttl=seconds,
                slot=slot,
            )
        self._log_conflict(key)
        return None

    def _recover(
        self, key: str, slot: int, owner: str, ttl: float, cause: DatabaseUnavailable
    ) -> Lease | None:
        try:
            info = self._read_owner(key, slot, owner)
        except DatabaseUnavailable:
            raise OutcomeUnknown(
                f"connection to {self.url} broke while acquiring {key!r} and the outcome "
                f"could not be read back; owner {owner} may hold it for up to {ttl}s",
                key,
                owner,
                self.url,
            ) from cause
        if info is not None and info.held:
            log.warning("acquire of %r committed before the connection broke; keeping it", key)
            return Lease(key, owner, info.token, info.acquired_at, info.expires_at, ttl, slot)
        log.warning("acquire of %r did not take effect before the connection broke; retrying", key)
        return None

    def _log_conflict(self, key: str) -> LockInfo | None:
        holder = self._current_holder(key)
        if holder is None:
            log.info("lock %r busy; holder released before it could be read", key)
        else:
            log.info("lock %r is held by %s", key, holder.describe())
        return holder

    def _current_holder(self, key: str) -> LockInfo | None:
        live = [info for info in self._rows(self._sql.get, {"key": key}) if info.held]
        return min(live, key=lambda i: i.expires_at) if live else None

    def release(self, lease: Lease) -> bool:
        """Give the lease back. ``True`` if this call ended it; ``False`` if it had
        already expired or been taken over (a stale owner never touches another's row)."""
        values = {"key": lease.key, "slot": lease.slot, "owner": lease.owner}
        try:
            _, count = self._db.run(self._sql.release, values)
        except DatabaseUnavailable as exc:
            info = self._reread_or_unknown(lease, "releasing", exc)
            if info is None or info.owner != lease.owner or not info.held:
                return False
            _, count = self._db.run(self._sql.release, values)
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
        try:
            rows, _ = self._db.run(self._sql.renew, values)
        except DatabaseUnavailable as exc:
            info = self._reread_or_unknown(lease, "renewing", exc)
            if info is None or info.owner != lease.owner or not info.held:
                return False
            rows, _ = self._db.run(self._sql.renew, values)
        if not rows:
            return False
        lease.expires_at = self._sql.to_datetime(rows[0][2])
        lease.ttl = seconds
        return True

    def adopt(self, key: str, owner: str, ttl: float | timedelta, *, slot: int = 0) -> Lease | None:
        """Take over a live lease by its owner id (e.g. one a publisher acquired and
        handed to the worker in the message), renewing it to ``ttl``.
        ``None`` if that owner no longer holds the key."""
        key = normalize_key(key)
        seconds = validate_ttl(ttl)
        values = {"key": key, "slot": slot, "owner": owner, "ttl": self._sql.seconds_param(seconds)}
        rows, _ = self._db.run(self._sql.renew, values)
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
        )

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

    def is_held_by(self, lease: Lease) -> bool:
        """Whether ``lease`` is still live by the database clock (one read)."""
        info = self._read_owner(lease.key, lease.slot, lease.owner)
        return info is not None and info.held

    def _read_owner(self, key: str, slot: int, owner: str) -> LockInfo | None:
        rows = self._rows(self._sql.get_owner, {"key": key, "slot": slot, "owner": owner})
        return rows[0] if rows else None

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

    # -- inspection and operations ------------------------------------------------------

    def get(self, key: str) -> LockInfo | None:
        """The row for ``key`` (slot 0 for a mutex), live or not; ``None`` if there is
        none. ``info.held`` says whether it is live by the database clock."""
        rows = self._rows(self._sql.get, {"key": normalize_key(key)})
        if not rows:
            return None
        live = [r for r in rows if r.held]
        return live[0] if live else rows[0]

    def get_all(self, key: str) -> list[LockInfo]:
        """Every slot row for ``key`` (several under a concurrency limit)."""
        return self._rows(self._sql.get, {"key": normalize_key(key)})

    def held(
        self,
        prefix: str | None = None,
        *,
        include_expired: bool = False,
        limit: int = _DEFAULT_LIMIT,
    ) -> list[LockInfo]:
        """Live leases (or every row with ``include_expired``) whose key starts with
        ``prefix``, ordered by key."""
        if prefix is not None and not isinstance(prefix, str):
            raise InvalidKey(f"prefix must be a str, not {type(prefix).__name__}", prefix)
        stmt = self._sql.held_all if include_expired else self._sql.held
        return self._rows(stmt, {"prefix": prefix or "", "limit": int(limit)})

    def force_release(self, key: str) -> bool:
        """Operator override: end every live lease on ``key`` whoever holds it.
        The holder's next renew/release returns ``False``. ``True`` if one was live."""
        key = normalize_key(key)
        _, count = self._db.run(self._sql.force_release, {"key": key})
        if count:
            log.warning("force-released %r (%d live lease(s))", key, count)
        return count > 0

    def reap(
        self,
        *,
        grace: float | timedelta = 300.0,
        batch_size: int = 5_000,
        max_batches: int | None = None,
        progress: Any = None,
    ) -> ReapResult:
        """Delete rows whose lease ended more than ``grace`` seconds ago, in batches of
        ``batch_size`` (each its own short transaction). Live leases are never touched;
        two reapers may run at once. ``progress(removed_so_far)`` is called per batch.

        ``grace`` must exceed the longest an acquire statement can run: the row is
        what keeps a late, slow acquire from reusing a lower fencing token.
        """
        grace_s = 0.0 if grace == 0 else validate_ttl(grace, name="grace")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        removed = batches = 0
        after_key, after_slot = "", -1
        grace_param = (
            self._sql.seconds_param(-grace_s) if self.dialect_name == "sqlite" else grace_s
        )
        while max_batches is None or batches < max_batches:
            values = {
                "after_key": after_key,
                "after_slot": after_slot,
                "grace": grace_param,
                "batch_size": batch_size,
            }
            rows, _ = self._db.run(self._sql.reap_batch, values)
            batches += 1
            if self.dialect_name == "sqlite":
                deleted, scanned = len(rows), len(rows)
                last = max(rows) if rows else None
            else:
                deleted, scanned, last_key, last_slot = rows[0]
                last = (last_key, last_slot) if last_key is not None else None
            removed += int(deleted)
            if progress is not None:
                progress(removed)
            if last is None or int(scanned) < batch_size:
                break
            after_key, after_slot = str(last[0]), int(last[1])
        if removed:
            log.info("reaped %d expired lock row(s) in %d batch(es)", removed, batches)
        return ReapResult(removed, batches)

    def db_now(self) -> Any:
        """The database clock (UTC), as lock statements see it."""
        rows, _ = self._db.run(self._sql.db_now, {})
        return self._sql.to_datetime(rows[0][0])

    def dispose(self) -> None:
        """Close the guard's connections (only if it created its own engine)."""
        self._db.dispose()

    # -- helpers -----------------------------------------------------------------------

    def _rows(self, stmt: Any, values: dict[str, Any]) -> list[LockInfo]:
        rows, _ = self._db.run(stmt, values)
        conv = self._sql.to_datetime
        return [
            LockInfo(
                key=r[0],
                slot=int(r[1]),
                owner=r[2],
                token=int(r[3]),
                acquired_at=conv(r[4]),
                expires_at=conv(r[5]),
                holder=Holder(task_name=r[6], task_id=r[7], hostname=r[8], pid=r[9]),
                read_at=conv(r[10]),
            )
            for r in rows
        ]
