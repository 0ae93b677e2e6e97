"""Lock history rows (``task_lock_events``): recording, reading back, trimming.

Recording is best-effort: it runs after the lock statement has done its work,
and a failure to record is logged, never raised, so history can never make a
lock operation fail.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from taskguard.dialects import Dialect, LockSQL, Statement
from taskguard.dialects.event_statements import KIND_SLOTS
from taskguard.exceptions import TaskGuardError
from taskguard.history import LockEvent, secs
from taskguard.lease import Holder, Lease, LockInfo, describe_holder
from taskguard.store.connections import Executor

__all__ = ["EventLog", "Recorder", "Unrecorded"]

log = logging.getLogger("taskguard")

_DETAIL_MAX = 500
#: The key reaper runs are recorded on (``taskguard explain taskguard:reaper``).
REAPER_KEY = "taskguard:reaper"


class EventLog:
    """The history statements of one :class:`~taskguard.store.Store`."""

    def __init__(self, db: Executor, sql: LockSQL, dialect: Dialect) -> None:
        self._db = db
        self._sql = sql
        self._dialect = dialect

    def trim(self, keep: float, batch_size: int) -> int:
        """Delete events older than ``keep`` seconds, in batches; how many went."""
        values = {"keep": self._dialect.seconds_param(-keep), "batch_size": batch_size}
        removed = 0
        while True:
            _, count = self._db.run(self._sql.trim_events, values)
            removed += max(count, 0)
            if count < batch_size:
                return removed

    def read(self, key: str, limit: int) -> list[LockEvent]:
        """The newest ``limit`` events of ``key`` as recorded, oldest first."""
        rows, _ = self._db.run(self._sql.events, {"key": key, "limit": limit})
        return [LockEvent.from_row(r, self._dialect.to_datetime) for r in reversed(rows)]

    def recent(self, since: datetime, kinds: Sequence[str], limit: int) -> list[LockEvent]:
        """The newest ``limit`` events of ``kinds`` (at most :data:`KIND_SLOTS`, at
        least one) of every key at or after ``since``, oldest first."""
        values: dict[str, Any] = {
            f"kind{i}": kinds[min(i, len(kinds) - 1)] for i in range(KIND_SLOTS)
        }
        values.update(since=self._dialect.ts_param(since), limit=limit)
        rows, _ = self._db.run(self._sql.recent_events, values)
        return [LockEvent.from_row(r, self._dialect.to_datetime) for r in reversed(rows)]

    def ended(self, lease: Lease, event: str, when: str, reason: str | None = None) -> None:
        """``released`` or ``lost`` (found so ``when``), named after the grant's holder;
        ``reason``: why it was released for its holder (a killed run)."""
        detail = (
            f"found expired or taken over {when}"
            if event == "lost"
            else (f"key kept until the {lease.min_hold:g}s window ends" if lease.min_hold else None)
        )
        if reason:
            detail = f"{reason}; {detail}" if detail else reason
        self.record(
            event,
            lease.key,
            lease.slot,
            lease.owner,
            lease.token,
            since=lease.acquired_at,
            detail=detail,
            stmt=self._sql.record_ended,
        )

    def handed_over(self, from_owner: str, lease: Lease, holder: Holder) -> None:
        """An exclusive adoption: the old owner's grant ends, the new owner's starts."""
        self.record(
            "released",
            lease.key,
            lease.slot,
            from_owner,
            lease.token,
            since=lease.acquired_at,
            detail=f"handed over to owner {lease.owner}",
            stmt=self._sql.record_ended,
        )
        self.record(
            "acquired",
            lease.key,
            lease.slot,
            lease.owner,
            lease.token,
            holder,
            duration=0.0,
            detail=f"handed over by owner {from_owner}",
        )

    def force_released(
        self, key: str, ended: list[tuple[int, str, int, Holder]], by: str | None
    ) -> None:
        """Each lease a force release ended, with the operator's name."""
        for slot, owner, token, holder in ended:
            self.record(
                "force_released",
                key,
                slot,
                owner,
                token,
                holder,
                detail=f"ended by {by or 'an operator'} (force_release)",
            )

    def record(
        self,
        event: str,
        key: str,
        slot: int,
        owner: str | None,
        token: int | None,
        holder: Holder | None = None,
        *,
        since: datetime | None = None,
        duration: float | None = None,
        detail: str | None = None,
        stmt: Statement | None = None,
    ) -> None:
        """Record one event; ``duration`` as given, else measured by the database
        clock from ``since`` to now. A failure is logged, never raised."""
        h = holder or Holder()
        self._quietly(
            stmt or self._sql.record_event,
            {
                "key": key,
                "slot": slot,
                "event": event,
                "owner": owner,
                "token": token,
                "duration": duration,
                "since": None if since is None else self._dialect.ts_param(since),
                "task_name": h.task_name,
                "task_id": h.task_id,
                "hostname": h.hostname,
                "pid": h.pid,
                "detail": detail[:_DETAIL_MAX] if detail else None,
            },
        )

    def acquired(
        self, lease: Lease, values: Mapping[str, Any], waited: float | None, detail: str | None
    ) -> None:
        """Record a grant (whether it took over a lease that ended without release is
        decided when the story is read: :func:`taskguard.history.story`)."""
        self._quietly(
            self._sql.record_event,
            {
                "key": lease.key,
                "slot": lease.slot,
                "event": "acquired",
                "owner": lease.owner,
                "token": lease.token,
                "duration": waited or 0.0,
                "since": None,
                "task_name": values["task_name"],
                "task_id": values["task_id"],
                "hostname": values["hostname"],
                "pid": values["pid"],
                "detail": detail,
            },
        )

    def reaped(self, rows: list[tuple[Any, ...]]) -> None:
        """Record reaped rows (key, slot, owner, token) where a reap batch could not."""
        if self._sql.reaped_events is not None:
            self._quietly(self._sql.reaped_events, {"rows": json.dumps([list(r) for r in rows])})

    def reap_ran(self, removed: int, batches: int, by: str | None) -> None:
        """One ``reap`` event per reaper run, on :data:`REAPER_KEY` (``/healthz``
        reads when the reaper was last seen), with the operator's name if one asked."""
        detail = f"removed {removed} row(s) in {batches} batch(es)"
        who = f"; requested by {by}" if by else ""
        self.record("reap", REAPER_KEY, 0, None, None, detail=detail + who)

    def _quietly(self, stmt: Statement, values: Mapping[str, Any]) -> None:
        try:
            self._db.run(stmt, values)
        except TaskGuardError as exc:
            log.warning("could not record lock history: %s", exc)


#: Takes any arguments and does nothing, in C: a record call with history off costs
#: no Python line on a run's path (``str.format`` ignores arguments it does not use).
_NOTHING: Callable[..., Any] = "".format


class Recorder:
    """What a :class:`~taskguard.TaskGuard` with ``history=True`` records in the lock
    history: every grant, conflict, release, loss, hand-over, force release and reaper
    run. History off: :class:`Unrecorded`. The guard decides once which it has."""

    #: Where a reap records the rows it removed (None: nowhere).
    reaped_to: EventLog | None

    def __init__(self, log: EventLog) -> None:
        self._log = self.reaped_to = log

    def acquired(
        self, lease: Lease, values: Mapping[str, Any], waited: float | None = None
    ) -> None:
        detail = f"throttle window {secs(lease.min_hold)}" if lease.min_hold else None
        self._log.acquired(lease, values, waited, detail)

    def refused(
        self, values: Mapping[str, Any], holder: Holder, waited: float | None, seen: LockInfo | None
    ) -> None:
        what = f"held by {describe_holder(seen)}"
        detail = f"gave up; {what}" if waited else what
        key, slot, owner = values["key"], values["slot"], values["owner"]
        self._log.record("conflict", key, slot, owner, None, holder, duration=waited, detail=detail)

    def released(self, lease: Lease, ended: bool, by_statement: bool, reason: str | None) -> None:
        """A release's outcome: ``released``, or ``lost`` (found ended at release);
        nothing when it was read back (``by_statement`` False: not known to be ours)."""
        if by_statement:
            self._log.ended(lease, "released" if ended else "lost", "at release", reason)

    def lost(self, lease: Lease) -> None:
        """A renewal found the lease ended."""
        self._log.ended(lease, "lost", "at renewal")

    def handed_over(self, from_owner: str, lease: Lease, holder: Holder) -> None:
        self._log.handed_over(from_owner, lease, holder)

    def event(self, key: str, event: str, detail: str, holder: Holder) -> None:
        """An integration's event (``coalesced``)."""
        self._log.record(event, key, 0, None, None, holder, detail=detail)

    def force_released(
        self, key: str, ended: list[tuple[int, str, int, Holder]], by: str | None
    ) -> None:
        self._log.force_released(key, ended, by)

    def reap_ran(self, removed: int, batches: int, by: str | None, trim: Callable[[], Any]) -> None:
        """A reaper run, then the history trimmed (``trim()``)."""
        self._log.reap_ran(removed, batches, by)
        trim()


class Unrecorded(Recorder):
    """History off: nothing is recorded but what an operator names (``by=`` of a
    force release or a reaper run)."""

    reaped_to = None
    acquired = refused = released = lost = handed_over = event = _NOTHING

    def __init__(self, log: EventLog) -> None:
        self._log = log

    def force_released(
        self, key: str, ended: list[tuple[int, str, int, Holder]], by: str | None
    ) -> None:
        if by:
            super().force_released(key, ended, by)

    def reap_ran(self, removed: int, batches: int, by: str | None, trim: Callable[[], Any]) -> None:
        if by:
            self._log.reap_ran(removed, batches, by)
