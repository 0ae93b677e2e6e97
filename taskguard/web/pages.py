"""What each page shows, read from the guard (no SQL here): plain values for the
templates and the JSON endpoints."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from taskguard.companions import KINDS, companion_rows, describe_companions, kind
from taskguard.display import printable, printable_event, printable_info
from taskguard.guard import TaskGuard
from taskguard.history import explain
from taskguard.lease import LockInfo
from taskguard.preflight import CheckResult, check_database

__all__ = ["KeyView", "Overview", "health", "key_view", "locks", "overview", "role"]

#: Rows a page lists at most (``taskguard locks --limit``).
ROWS = 1_000
#: Keys whose history the overview's chart reads at most.
CHART_KEYS = 100
CHART_HOURS = 24


def role(info: LockInfo) -> str:
    """held, expired, or the name of a companion row's kind (``taskguard locks --all``)."""
    if not info.held:
        return "expired"
    named = kind(info.key)
    return "held" if named is None else KINDS[named]


def locks(
    guard: TaskGuard,
    *,
    state: str = "held",
    prefix: str | None = None,
    task: str | None = None,
    companions: bool = False,
) -> list[LockInfo]:
    """The Locks page's rows: ``state`` held, expired or all; ``task``: the task
    name contains it; companion rows only with ``companions``."""
    rows = guard.held(
        prefix or None, include_expired=state != "held", companions=companions, limit=ROWS
    )
    if state == "expired":
        rows = [r for r in rows if not r.held]
    if task:
        rows = [r for r in rows if task in (r.holder.task_name or "")]
    return rows


@dataclass
class Overview:
    now: datetime
    held: int
    expired: int
    #: Keys with a live lease, and those of them with several (under a limit).
    keys: int
    shared: int
    oldest: LockInfo | None
    #: Conflicts per hour, oldest hour first (``None``: no history on these keys).
    conflicts: list[int] | None
    chart_keys: int
    truncated: bool
    problems: list[str] = field(default_factory=list)


def overview(guard: TaskGuard) -> Overview:
    rows = guard.held(include_expired=True, limit=ROWS)
    live = [r for r in rows if r.held]
    holders = Counter(r.key for r in live)
    # The chart reads the history of keys held now first, then of expired rows.
    keys = list({r.key: None for r in sorted(rows, key=lambda r: not r.held)})[:CHART_KEYS]
    now = rows[0].read_at if rows else guard.db_now()
    return Overview(
        now=now,
        held=len(live),
        expired=len(rows) - len(live),
        keys=len(holders),
        shared=sum(n > 1 for n in holders.values()),
        oldest=max(live, key=lambda r: r.held_for, default=None),
        conflicts=conflicts_per_hour(guard, keys, now),
        chart_keys=len(keys),
        truncated=len(rows) >= ROWS,
    )


def conflicts_per_hour(guard: TaskGuard, keys: list[str], now: datetime) -> list[int] | None:
    """Conflicts per hour over the last day on ``keys``, from their histories."""
    since = now - timedelta(hours=CHART_HOURS)
    hours: Counter[int] = Counter()
    recorded = False
    for key in keys:
        for event in guard.events(key, limit=500):
            recorded = True
            if event.event == "conflict" and event.at > since:
                hours[int((event.at - since).total_seconds() // 3600)] += 1
    return [hours[h] for h in range(CHART_HOURS)] if recorded else None


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
    payload = {
        "key": key,
        "events": [e.to_dict() for e in events],
        "rows": [r.to_dict() for r in rows],
        "companions": lines,
    }
    return KeyView(key, rows, extra, story, payload)


def health(guard: TaskGuard) -> CheckResult:
    """``taskguard check`` on the guard's engine: reachable, schema at head, privileges."""
    return check_database(guard.engine)
