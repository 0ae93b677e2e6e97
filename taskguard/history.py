"""Lock history (opt-in): the ``task_lock_events`` table and ``taskguard explain``.

With ``TaskGuard(..., history=True)`` every grant, conflict, release, lost lease,
takeover, operator release and reaped row becomes one row of
``task_lock_events``. Recording is best-effort: it runs after the lock statement
has done its work, and a failure to record is logged, never raised, so history
can never make a lock operation fail. With history off nothing here runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from taskguard.exceptions import TaskGuardError
from taskguard.lease import Holder, Lease, LockInfo

if TYPE_CHECKING:
    from taskguard.operations import GuardOperations

__all__ = ["EVENTS", "LockEvent", "explain", "record", "record_acquired", "with_holders"]

log = logging.getLogger("taskguard")

#: Every kind of event, in the words ``taskguard explain`` uses.
EVENTS = {
    "acquired": "acquired",
    "conflict": "turned away",
    "released": "released",
    "lost": "lost",
    "taken_over": "taken over",
    "force_released": "force-released",
    "reaped": "reaped",
}
_DETAIL_MAX = 500


@dataclass(frozen=True, slots=True)
class LockEvent:
    """One row of ``task_lock_events``."""

    id: int
    at: datetime
    key: str
    slot: int
    event: str
    owner: str | None
    token: int | None
    #: Seconds: held for (ending events) or waited (acquired / conflict).
    duration: float | None
    holder: Holder
    detail: str | None

    @classmethod
    def from_row(cls, row: Sequence[Any], to_datetime: Callable[[Any], datetime]) -> LockEvent:
        (id_, at, key, slot, event, owner, token, duration, name, tid, host, pid, detail) = row
        return cls(
            id=int(id_),
            at=to_datetime(at),
            key=key,
            slot=int(slot),
            event=event,
            owner=owner,
            token=None if token is None else int(token),
            duration=None if duration is None else float(duration),
            holder=Holder(task_name=name, task_id=tid, hostname=host, pid=pid),
            detail=detail,
        )

    def describe(self) -> str:
        """One line of the story, without the timestamp."""
        parts = [f"{EVENTS.get(self.event, self.event):<14}"]
        if self.owner:
            parts.append(f"owner {self.owner}")
        if self.token is not None:
            parts.append(f"token {self.token}")
        if self.slot:
            parts.append(f"slot {self.slot}")
        who = _who(self.holder)
        if who:
            parts.append(f"({who})")
        if self.duration is not None:
            verb = "waited" if self.event in ("acquired", "conflict") else "held"
            if self.event != "acquired" or self.duration > 0:
                parts.append(f"{verb} {_secs(self.duration)}")
        if self.detail:
            parts.append(f"- {self.detail}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, object]:
        """A JSON-friendly form (``taskguard explain --json``)."""
        return {
            "at": self.at.isoformat(),
            "key": self.key,
            "slot": self.slot,
            "event": self.event,
            "owner": self.owner,
            "token": self.token,
            "duration_seconds": None if self.duration is None else round(self.duration, 3),
            "task_name": self.holder.task_name,
            "task_id": self.holder.task_id,
            "hostname": self.holder.hostname,
            "pid": self.holder.pid,
            "detail": self.detail,
        }


def with_holders(events: list[LockEvent]) -> list[LockEvent]:
    """Fill in holder details of events that end a grant (released, lost, reaped…)
    from that owner's ``acquired`` event: they are recorded by owner only."""
    holders = {e.owner: e.holder for e in events if e.event == "acquired"}
    return [
        replace(e, holder=holders[e.owner])
        if e.holder == Holder() and e.owner in holders and e.event != "conflict"
        else e
        for e in events
    ]


def _who(h: Holder) -> str:
    return " ".join(
        p
        for p in (
            f"task {h.task_name}" if h.task_name else None,
            f"id {h.task_id}" if h.task_id else None,
            f"on {h.hostname}" if h.hostname else None,
            f"pid {h.pid}" if h.pid is not None else None,
        )
        if p
    )


def _secs(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def guarded(run: Callable[..., Any], *args: Any) -> None:
    """Run a history statement; log instead of raising if it fails."""
    try:
        run(*args)
    except TaskGuardError as exc:
        log.warning("could not record lock history: %s", exc)


def record(
    guard: GuardOperations,
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
) -> None:
    """Record one event. ``duration`` is taken as given, else measured by the
    database clock from ``since`` to now (``None`` if neither)."""
    sql = guard._sql
    h = holder or Holder()
    values = {
        "key": key,
        "slot": slot,
        "event": event,
        "owner": owner,
        "token": token,
        "duration": duration,
        "since": None if since is None else sql.ts_param(since),
        "task_name": h.task_name,
        "task_id": h.task_id,
        "hostname": h.hostname,
        "pid": h.pid,
        "detail": detail[:_DETAIL_MAX] if detail else None,
    }
    guarded(guard._db.run, sql.record_event, values)


def record_acquired(
    guard: GuardOperations, lease: Lease, values: dict[str, Any], waited: float | None
) -> None:
    """Record a grant, and ``taken_over`` for the slot's previous grant if that one
    ended without being released (found from history, in the same statement)."""
    detail = f"throttle window {_secs(lease.min_hold)}" if lease.min_hold else None
    params = {
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
    }
    guarded(guard._db.run, guard._sql.record_acquired, params)


def explain(key: str, events: Sequence[LockEvent], rows: Sequence[LockInfo]) -> str:
    """The story of ``key``: its recent events, oldest first, then its state now."""
    lines = [f"lock {key!r}"]
    if events:
        lines.append(f"history (last {len(events)} event(s), oldest first):")
        for ev in events:
            stamp = ev.at.isoformat(sep=" ", timespec="milliseconds")
            lines.append(f"  {stamp}  {ev.describe()}")
    else:
        lines.append("history: none recorded (is history on? TaskGuard(..., history=True))")
    live = [r for r in rows if r.held]
    if live:
        lines.append(f"now: held ({len(live)} holder(s))")
        for r in live:
            who = _who(r.holder)
            lines.append(
                f"  slot {r.slot}: owner {r.owner} token {r.token}"
                f"{f' ({who})' if who else ''}, held for {_secs(r.held_for.total_seconds())}, "
                f"expires in {_secs(r.expires_in.total_seconds())}"
            )
    elif rows:
        last = max(rows, key=lambda r: r.expires_at)
        ago = -last.expires_in.total_seconds()
        lines.append(f"now: free (last lease, owner {last.owner}, ended {_secs(ago)} ago)")
    else:
        lines.append("now: free (no row)")
    return "\n".join(lines)
