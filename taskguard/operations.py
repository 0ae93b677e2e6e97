"""Inspection and maintenance half of :class:`taskguard.TaskGuard`: reading rows,
the operator override, the reaper, lock history. Kept apart from the lease
operations in :mod:`taskguard.guard`, which carry the hot path."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from taskguard import history as _history
from taskguard.dialects._history import PG_REAP_START
from taskguard.exceptions import InvalidKey
from taskguard.keys import normalize_key, validate_ttl
from taskguard.lease import Holder, Lease, LockInfo

if TYPE_CHECKING:
    from taskguard._db import Executor
    from taskguard.dialects import LockSQL, Statement

__all__ = ["DEFAULT_HISTORY_RETENTION", "GuardOperations", "ReapResult"]

log = logging.getLogger("taskguard")

# Cap on rows returned by held(); an operator listing more wants SQL, not a list.
_DEFAULT_LIMIT = 10_000
#: Lock history older than this is trimmed by the reaper (seconds: one week).
DEFAULT_HISTORY_RETENTION = 7 * 24 * 3600.0


class ReapResult(int):
    """Number of rows a reap removed (an ``int``), plus how many batches it took."""

    batches: int

    def __new__(cls, removed: int, batches: int) -> ReapResult:
        obj = super().__new__(cls, removed)
        obj.batches = batches
        return obj


class GuardOperations:
    """Mixin: everything a :class:`~taskguard.TaskGuard` does besides leasing."""

    _db: Executor
    _sql: LockSQL
    history: bool
    history_retention: float

    @property
    def dialect_name(self) -> str:
        return self._sql.dialect_name

    # -- reading back, conflicts, history of lease operations ---------------------

    def is_held_by(self, lease: Lease) -> bool:
        """Whether ``lease`` is still live by the database clock (one read)."""
        info = self._read_owner(lease.key, lease.slot, lease.owner)
        return info is not None and info.held

    def _read_owner(self, key: str, slot: int, owner: str) -> LockInfo | None:
        rows = self._rows(self._sql.get_owner, {"key": key, "slot": slot, "owner": owner})
        return rows[0] if rows else None

    def _conflict(self, key: str, values: dict[str, Any], waited: float | None = None) -> None:
        holder = self._current_holder(key)
        gave_up = f" (gave up after waiting {waited:.3f}s)" if waited else ""
        if holder is None:
            log.info("lock %r busy; holder released before it could be read%s", key, gave_up)
        else:
            log.info("lock %r is held by %s%s", key, holder.describe(), gave_up)
        if self.history:
            what = f"held by {holder.describe()}" if holder else "holder released before read"
            _history.record(
                self,
                "conflict",
                key,
                values["slot"],
                values["owner"],
                None,
                Holder(*(values[c] for c in ("task_name", "task_id", "hostname", "pid"))),
                duration=waited,
                detail=f"gave up; {what}" if waited else what,
            )

    def _current_holder(self, key: str) -> LockInfo | None:
        live = [info for info in self._rows(self._sql.get, {"key": key}) if info.held]
        return min(live, key=lambda i: i.expires_at) if live else None

    def _record_end(self, lease: Lease, event: str, when: str) -> None:
        detail = (
            f"found expired or taken over {when}"
            if event == "lost"
            else (f"key kept until the {lease.min_hold:g}s window ends" if lease.min_hold else None)
        )
        _history.record(
            self, event, lease.key, lease.slot, lease.owner, lease.token,
            since=lease.acquired_at, detail=detail,
        )  # fmt: skip

    # -- inspection and operations ----------------------------------------------

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
        rows, _ = self._db.run(self._sql.force_release, {"key": key})
        if rows:
            log.warning("force-released %r (%d live lease(s))", key, len(rows))
            if self.history:
                for slot, owner, token, *details in rows:
                    _history.record(
                        self,
                        "force_released",
                        key,
                        slot,
                        owner,
                        token,
                        Holder(*details),
                        detail="ended by an operator (force_release)",
                    )
        return bool(rows)

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

        With lock history on, each removed row is recorded as ``reaped`` and history
        older than ``history_retention`` is trimmed afterwards.
        """
        grace_s = 0.0 if grace == 0 else validate_ttl(grace, name="grace")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        sqlite = self.dialect_name == "sqlite"
        stmt = self._sql.reap_batch_history if self.history else self._sql.reap_batch
        removed = batches = 0
        # Where the next batch starts: SQLite walks the primary key, PostgreSQL the
        # heap (a ctid), see taskguard.dialects._history.
        after: dict[str, Any] = (
            {"after_key": "", "after_slot": -1} if sqlite else {"after": PG_REAP_START}
        )
        grace_param = self._sql.seconds_param(-grace_s) if sqlite else grace_s
        while max_batches is None or batches < max_batches:
            values = {**after, "grace": grace_param, "batch_size": batch_size}
            rows, _ = self._db.run(stmt, values)
            batches += 1
            if sqlite:
                deleted = scanned = len(rows)
                if rows:
                    last_key, last_slot = max((r[0], r[1]) for r in rows)
                    after = {"after_key": str(last_key), "after_slot": int(last_slot)}
                if rows and self.history and self._sql.reaped_events is not None:
                    _history.guarded(
                        self._db.run,
                        self._sql.reaped_events,
                        {"rows": json.dumps([list(r) for r in rows])},
                    )
            else:
                deleted, scanned, last = rows[0]
                if last is not None:
                    after = {"after": str(last)}
            removed += int(deleted)
            if progress is not None:
                progress(removed)
            if int(scanned) < batch_size:
                break
        if removed:
            log.info("reaped %d expired lock row(s) in %d batch(es)", removed, batches)
        if self.history:
            self.trim_history(batch_size=batch_size)
        return ReapResult(removed, batches)

    def trim_history(
        self, older_than: float | timedelta | None = None, *, batch_size: int = 5_000
    ) -> int:
        """Delete lock history older than ``older_than`` seconds (default: the
        guard's ``history_retention``), in batches. Returns the number removed."""
        keep = self.history_retention if older_than is None else validate_ttl(older_than)
        values = {"keep": self._sql.seconds_param(-keep), "batch_size": batch_size}
        removed = 0
        while True:
            _, count = self._db.run(self._sql.trim_events, values)
            removed += max(count, 0)
            if count < batch_size:
                break
        if removed:
            log.info("trimmed %d lock history event(s) older than %gs", removed, keep)
        return removed

    def events(self, key: str, *, limit: int = 50) -> list[_history.LockEvent]:
        """The most recent ``limit`` history events of ``key``, oldest first (empty
        unless some guard records history: ``TaskGuard(..., history=True)``)."""
        rows, _ = self._db.run(self._sql.events, {"key": normalize_key(key), "limit": limit})
        events = [_history.LockEvent.from_row(r, self._sql.to_datetime) for r in reversed(rows)]
        return _history.with_holders(events)

    def explain(self, key: str, *, limit: int = 50) -> str:
        """The recent story of ``key`` as text: who held it, for how long, who was
        turned away, and its state now (``taskguard explain KEY``)."""
        key = normalize_key(key)
        return _history.explain(key, self.events(key, limit=limit), self.get_all(key))

    def db_now(self) -> datetime:
        """The database clock (UTC), as lock statements see it."""
        rows, _ = self._db.run(self._sql.db_now, {})
        return self._sql.to_datetime(rows[0][0])

    def dispose(self) -> None:
        """Close the guard's connections (only if it created its own engine)."""
        self._db.dispose()

    def _rows(self, stmt: Statement, values: dict[str, Any]) -> list[LockInfo]:
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
