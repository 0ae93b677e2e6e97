"""What each page shows, read from the guard (no SQL here): plain values for the
templates and the JSON endpoints."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from taskguard.companions import KINDS, companion_rows, describe_companions, kind
from taskguard.display import (
    format_duration,
    printable,
    printable_event,
    printable_info,
    slots_in_use,
)
from taskguard.guard import TaskGuard
from taskguard.history import EVENTS, LockEvent, explain
from taskguard.lease import LockInfo
from taskguard.options import Phase
from taskguard.startup_check import CheckResult, check_database

__all__ = [
    "PHASES",
    "Listing",
    "Overview",
    "health",
    "key_view",
    "locks",
    "overview",
    "reaper_seen",
    "role",
]

#: Rows a page lists at most (``taskguard locks --limit``).
ROWS = 1_000
#: History events the overview's chart reads at most, and which.
CHART_EVENTS = 20_000
CHART_KINDS = ("conflict", "coalesced")
CHART_HOURS = 24
#: The Locks page's phase filter: the phases a row records, and ``none`` (not recorded:
#: a plain acquire, or a row older than the phase column).
PHASES: dict[str, Phase | None] = {str(p): p for p in (Phase.QUEUE, Phase.RUN)} | {"none": None}


def role(info: LockInfo) -> str:
    """held, expired, or the name of a companion row's kind (``taskguard locks --all``)."""
    if not info.held:
        return "expired"
    named = kind(info.key)
    return "held" if named is None else KINDS[named]


@dataclass
class Listing:
    """The Locks page's rows, and the live rows of each of their keys (``2 of 3``)."""

    rows: list[LockInfo]
    in_use: Counter[str]

    def to_json(self) -> list[dict[str, object]]:
        return [r.to_dict(self.in_use[r.key]) for r in self.rows]


def locks(
    guard: TaskGuard,
    *,
    state: str = "held",
    prefix: str | None = None,
    task: str | None = None,
    phase: str = "",
    companions: bool = False,
) -> Listing:
    """The Locks page's rows: ``state`` held, expired or all; ``task``: the task
    name contains it; ``phase``: a key of :data:`PHASES` (empty: any); companion rows
    only with ``companions``. Slots in use are counted before the filters."""
    rows = guard.held(
        prefix or None, include_expired=state != "held", companions=companions, limit=ROWS
    )
    in_use = slots_in_use(rows)
    if state == "expired":
        rows = [r for r in rows if not r.held]
    if task:
        rows = [r for r in rows if task in (r.holder.task_name or "")]
    if phase:
        wanted = PHASES[phase]
        rows = [r for r in rows if r.phase is wanted]
    return Listing(rows, in_use)


@dataclass
class Overview:
    now: datetime
    held: int
    expired: int
    #: Keys with a live lease, and those of them at their limit: as many live rows as
    #: the limit their grants recorded (rows older than that record: every slot row of
    #: the key live, as a slot never taken has no row).
    keys: int
    at_limit: int
    #: Keys someone waits for (``acquire(wait=)`` inside its wait).
    waited_for: int
    oldest: LockInfo | None
    #: Conflicts per hour, oldest hour first (``None``: no history recorded).
    conflicts: list[int] | None
    #: The same per (task, outcome), busiest first.
    series: list[Series]
    #: The reaper's newest run recorded over the chart's day (``None``: none).
    reaped: LockEvent | None
    truncated: bool
    #: The chart read its limit of events: the oldest hours may be short.
    chart_truncated: bool
    problems: list[str] = field(default_factory=list)


@dataclass
class Series:
    task: str
    outcome: str
    hours: list[int]


def overview(guard: TaskGuard) -> Overview:
    rows = guard.held(include_expired=True, limit=ROWS)
    live = [r for r in rows if r.held]
    holders = slots_in_use(live)
    free = {r.key for r in rows if not r.held}
    limits = {r.key: r.slots for r in live if r.slots is not None}
    now = rows[0].read_at if rows else guard.db_now()
    since = now - timedelta(hours=CHART_HOURS)
    events = guard.recent_events(since=since, kinds=CHART_KINDS, limit=CHART_EVENTS)
    reaped = guard.recent_events(since=since, kinds=["reap"], limit=1)
    series = conflicts_per_hour(events, now)
    return Overview(
        now=now,
        held=len(live),
        expired=len(rows) - len(live),
        keys=len(holders),
        at_limit=sum(
            n >= limits[key] if key in limits else key not in free for key, n in holders.items()
        ),
        waited_for=guard.waited_for(),
        oldest=max(live, key=lambda r: r.held_for, default=None),
        conflicts=[sum(h) for h in zip(*(s.hours for s in series), strict=True)]
        if series
        else (None if not guard.history else [0] * CHART_HOURS),
        series=series,
        reaped=reaped[0] if reaped else None,
        truncated=len(rows) >= ROWS,
        chart_truncated=len(events) >= CHART_EVENTS,
    )


def outcome(event: LockEvent) -> str:
    """What became of a refused start: merged into a pending run, turned away at
    once, or given up after waiting."""
    if event.event != "conflict":
        return EVENTS[event.event]
    return "gave up waiting" if event.duration else EVENTS["conflict"]


def conflicts_per_hour(events: list[LockEvent], now: datetime) -> list[Series]:
    """Conflicts per hour over the last day per (task, outcome), busiest first."""
    since = now - timedelta(hours=CHART_HOURS)
    counts: dict[tuple[str, str], list[int]] = {}
    for event in events:
        hour = min(int((event.at - since).total_seconds() // 3600), CHART_HOURS - 1)
        name = (event.holder.task_name or "(no task name)", outcome(event))
        counts.setdefault(name, [0] * CHART_HOURS)[max(hour, 0)] += 1
    found = [Series(task, how, hours) for (task, how), hours in counts.items()]
    return sorted(found, key=lambda s: (-sum(s.hours), s.task, s.outcome))


def chart(counts: list[int], width: int = 480, height: int = 120) -> dict[str, Any]:
    """Bar geometry for the inline SVG (one bar per hour)."""
    top = max(counts) or 1
    step = width / len(counts)
    bars = [
        {
            "x": round(i * step + 1, 1),
            "w": round(step - 2, 1),
            "h": round(c / top * (height - 20), 1),
            "y": round(height - 14 - c / top * (height - 20), 1),
            "n": c,
            "ago": len(counts) - i,
        }
        for i, c in enumerate(counts)
    ]
    return {"bars": bars, "width": width, "height": height, "top": top}


@dataclass
class KeyView:
    key: str
    rows: list[LockInfo]
    companions: list[LockInfo]
    story: str
    payload: dict[str, Any]
    #: Live rows per key among ``rows`` and ``companions``.
    in_use: Counter[str]

    @property
    def live(self) -> list[LockInfo]:
        return [r for r in self.rows if r.held]


def key_view(guard: TaskGuard, key: str, limit: int = 50) -> KeyView:
    """A key's story (``taskguard explain``'s text) and rows (``taskguard show --all``)."""
    events, rows = guard.events(key, limit=limit), guard.get_all(key)
    held = functools.partial(guard.held, companions=True)
    extra = companion_rows(key, held)
    lines = describe_companions(key, lambda _prefix: extra)
    story = explain(key, [printable_event(e) for e in events], [printable_info(r) for r in rows])
    story = "\n".join([story, *(printable(line, backslashes=False) for line in lines)])
    in_use = slots_in_use(rows + extra)
    payload = {
        "key": key,
        "events": [e.to_dict() for e in events],
        "rows": [r.to_dict(in_use[r.key]) for r in rows],
        "companions": lines,
    }
    return KeyView(key, rows, extra, story, payload, in_use)


def health(guard: TaskGuard) -> CheckResult:
    """``taskguard check`` on the guard's engine: reachable, schema at head, privileges."""
    return check_database(guard.engine)


def reaper_seen(guard: TaskGuard, interval: float) -> str | None:
    """When the reaper last ran, from its ``reap`` events; ``None`` if not within
    ``interval`` seconds. Its runs are recorded only with lock history on: without
    it (on this guard), "unknown"."""
    if not guard.history:
        return "unknown (its runs are recorded only with lock history on)"
    now = guard.db_now()
    since = now - timedelta(seconds=interval)
    runs = guard.recent_events(since=since, kinds=["reap"], limit=1)
    return f"ran {format_duration(now - runs[0].at)} ago" if runs else None
