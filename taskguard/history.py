"""Lock history (opt-in): the ``task_lock_events`` table and ``taskguard explain``.

With ``TaskGuard(..., history=True)`` every grant, conflict, release, lost lease,
operator release and reaped row becomes one row of ``task_lock_events``.
Recording (in :mod:`taskguard.store`) is best-effort: it runs after the lock
statement has done its work, and a failure to record is logged, never raised, so
history can never make a lock operation fail. This module reads the story back.

A takeover (a lease that ended without release, then granted to someone else) is
read from the recorded facts, not from the order they were written in: a grant
of which no release, operator release or reaping was ever recorded, followed by
another owner's grant of the same slot (a higher fencing token), was taken over
(:func:`story`). Its holder writes its release a fraction of a millisecond after
the release itself, which can be after the next holder's grant was recorded.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from taskguard.lease import Holder, LockInfo

__all__ = ["EVENTS", "LockEvent", "endings", "explain", "secs", "story", "what"]

#: Every kind of event, in the words ``taskguard explain`` uses.
EVENTS = {
    "acquired": "acquired",
    "conflict": "turned away",
    "coalesced": "merged",
    "released": "released",
    "lost": "lost",
    "taken_over": "taken over",
    "force_released": "force-released",
    "reaped": "reaped",
    "reap": "reaper ran",
}
#: Events after which a grant was not taken over: it was given back, ended by an
#: operator, or its row reaped (``taken_over``: recorded so by taskguard < 0.2).
RELEASED = ("released", "force_released", "reaped", "taken_over")
#: Events that end a grant in a told story (:func:`story`): those, and ``lost``.
ENDINGS = (*RELEASED, "lost")


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
        who = self.holder.describe()
        if who:
            parts.append(f"({who})")
        if self.duration is not None:
            verb = "waited" if self.event in ("acquired", "conflict") else "held"
            if self.event != "acquired" or self.duration > 0:
                parts.append(f"{verb} {secs(self.duration)}")
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


def story(events: list[LockEvent]) -> list[LockEvent]:
    """``events`` (oldest first) with holder details filled in (:func:`with_holders`)
    and a ``taken_over`` event before each grant that took over a lease that ended
    without release (see the module docstring)."""
    events = with_holders(events)
    released = {(e.slot, e.owner) for e in events if e.event in RELEASED}
    # A holder that recorded its lease lost before the next grant saw it end (it
    # expired): not taken over. Recorded after that grant: taken over from it.
    lost = {(e.slot, e.owner): e.at for e in events if e.event == "lost"}
    grants: dict[int, list[tuple[int, LockEvent]]] = {}
    for e in events:
        if e.event == "acquired" and e.token is not None:
            grants.setdefault(e.slot, []).append((e.token, e))
    before: dict[int, list[LockEvent]] = {}
    for slot_grants in grants.values():
        slot_grants.sort(key=lambda pair: pair[0])
        tokens = [token for token, _ in slot_grants]
        for token, prev in slot_grants:
            at = bisect.bisect_right(tokens, token)  # the next grant: the next higher token
            if (prev.slot, prev.owner) in released or at == len(tokens):
                continue
            nxt = slot_grants[at][1]
            if lost.get((prev.slot, prev.owner), nxt.at) < nxt.at:
                continue
            before.setdefault(nxt.id, []).append(
                replace(
                    prev,
                    at=nxt.at,
                    event="taken_over",
                    duration=max((nxt.at - prev.at).total_seconds(), 0.0),
                    detail=f"lease expired without release; taken over by owner {nxt.owner}",
                )
            )
    if not before:
        return events
    return [d for e in events for d in (*before.get(e.id, ()), e)]


def endings(told: Sequence[LockEvent]) -> dict[tuple[int, str | None], LockEvent]:
    """How each grant of a told story (:func:`story`'s events) ended, by ``(slot,
    owner)``: the first event that ended it (released, lost, taken over,
    force-released, reaped). A grant not in it has not ended as far as history says."""
    ends: dict[tuple[int, str | None], LockEvent] = {}
    for e in told:
        if e.event in ENDINGS:
            ends.setdefault((e.slot, e.owner), e)
    return ends


def what(event: LockEvent, ends: dict[tuple[int, str | None], LockEvent]) -> str:
    """The word for one recorded event (a list of events, such as the Django admin's,
    which has no line of its own for a takeover): a grant that :func:`story` found
    taken over says so. ``ends``: :func:`endings` of the told story."""
    word = EVENTS.get(event.event, event.event)
    end = ends.get((event.slot, event.owner)) if event.event == "acquired" else None
    if end is not None and end.event == "taken_over":
        return f"{word}; then {EVENTS['taken_over']} (lease expired without release)"
    return word


def secs(seconds: float) -> str:
    """A duration for people: milliseconds under two minutes, then h/m/s."""
    if seconds < 120:
        return f"{seconds:.3f}s"
    minutes, rest = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{rest:02d}s" if hours else f"{minutes}m{rest:02d}s"


def explain(key: str, events: Sequence[LockEvent], rows: Sequence[LockInfo]) -> str:
    """The story of ``key``: its recent events, oldest first, then its state now."""
    lines = [f"lock {key!r}"]
    if events:
        lines.append(f"history (last {len(events)} event(s), oldest first):")
        for ev in events:
            stamp = ev.at.isoformat(sep=" ", timespec="milliseconds")
            lines.append(f"  {stamp}  {ev.describe()}")
    else:
        lines.append(
            "history: none recorded (is history on? Celery: app.conf.taskguard_history = "
            "True; Django: TASKGUARD_HISTORY = True; Python: TaskGuard(..., history=True))"
        )
    live = [r for r in rows if r.held]
    if live:
        lines.append(f"now: held ({len(live)} holder(s))")
        for r in live:
            who = r.holder.describe()
            lines.append(
                f"  slot {r.slot}: owner {r.owner} token {r.token}"
                f"{f' ({who})' if who else ''}, held for {secs(r.held_for.total_seconds())}, "
                f"expires in {secs(r.expires_in.total_seconds())}"
            )
    elif rows:
        last = max(rows, key=lambda r: r.expires_at)
        ago = -last.expires_in.total_seconds()
        lines.append(f"now: free (last lease, owner {last.owner}, ended {secs(ago)} ago)")
    else:
        lines.append("now: free (no row)")
    return "\n".join(lines)
