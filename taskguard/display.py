"""Text for people: lock rows as tables and field lists, durations, and the one
escaping rule every human-readable output uses.

Keys, task names, task ids, hosts and owners come from whoever calls
``acquire``: they may hold newlines (which would forge a row of a table) or
terminal escape sequences. :func:`printable` shows them as backslash escapes,
so what reaches the terminal is always one inert line per row. JSON outputs do
not go through here: ``json.dumps`` escapes on its own and keeps values exact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Protocol

from taskguard.companions import KINDS, kind
from taskguard.history import EVENTS, LockEvent
from taskguard.lease import Holder, LockInfo

__all__ = [
    "format_duration",
    "lock_details",
    "locks_table",
    "phase_text",
    "printable",
    "printable_event",
    "printable_info",
    "slots_in_use",
    "slots_text",
    "table",
]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}

#: The columns of ``taskguard locks`` (and of the demo's mid-run listing).
LOCKS_HEADERS = (
    "KEY", "PHASE", "SLOT", "SLOTS", "TOKEN", "TASK", "HOST", "PID", "HELD FOR", "EXPIRES IN"
)  # fmt: skip


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: object, *, backslashes: bool = True) -> str:
    """``text`` with every character Python does not consider printable (controls,
    escape sequences' ESC, line and paragraph separators, bidi overrides, ...)
    written as ``\\n``, ``\\t``, ``\\x1b``, ``\\u202e``, ...

    Backslashes are doubled too, so an escaped newline and a literal ``\\n`` in a
    key never look alike; ``backslashes=False`` leaves them (for whole messages
    that quote their values with ``repr`` already)."""
    value = str(text)
    if value.isprintable() and (not backslashes or "\\" not in value):
        return value
    return "".join(
        ch if ch.isprintable() and (ch != "\\" or not backslashes) else _escape(ch) for ch in value
    )


def _optional(value: str | None) -> str | None:
    return None if value is None else printable(value)


def printable_info(info: LockInfo) -> LockInfo:
    """``info`` with its key, owner and holder details made :func:`printable`."""
    return replace(
        info, key=printable(info.key), owner=printable(info.owner), holder=_holder(info.holder)
    )


def printable_event(event: LockEvent) -> LockEvent:
    """A history event with its texts made :func:`printable` (for ``explain``)."""
    return replace(
        event,
        key=printable(event.key),
        owner=_optional(event.owner),
        holder=_holder(event.holder),
        detail=_optional(event.detail),
    )


def _holder(h: Holder) -> Holder:
    return Holder(
        task_name=_optional(h.task_name),
        task_id=_optional(h.task_id),
        hostname=_optional(h.hostname),
        pid=h.pid,
    )


def format_duration(value: timedelta) -> str:
    """``950ms``, ``12.3s``, ``4m05s``, ``2h03m``, ``3d04h``; negative with a leading ``-``."""
    seconds = value.total_seconds()
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    if seconds < 1:
        text = f"{seconds * 1000:.0f}ms"
    elif seconds < 60:
        text = f"{seconds:.1f}s"
    elif seconds < 3600:
        text = f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    elif seconds < 86400:
        text = f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    else:
        text = f"{int(seconds // 86400)}d{int(seconds % 86400 // 3600):02d}h"
    return sign + text


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: int = 0) -> list[str]:
    """Columns padded to the widest cell, the last ``right`` columns right-aligned.
    Every cell is made :func:`printable`, so no value can break the grid."""
    cells = [[printable(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    first_right = len(headers) - right

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if i >= first_right else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(headers), *(line(r) for r in cells)]


def _dash(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


class LockRow(Protocol):
    """What the phase and slots columns read of a lock row: a :class:`LockInfo`, or
    the Django admin's row of the ``task_locks_held`` view."""

    @property
    def key(self) -> str: ...
    @property
    def phase(self) -> str | None: ...
    @property
    def slots(self) -> int | None: ...


def phase_text(info: LockRow) -> str:
    """The lock phase of a row (``queue``, ``run``), or ``-``: a plain acquire, or a
    row written before phases were recorded."""
    return _dash(info.phase)


def slots_in_use(infos: Iterable[LockInfo]) -> Counter[str]:
    """Live rows per key among ``infos`` (read together: one database time)."""
    return Counter(info.key for info in infos if info.held)


def slots_text(info: LockRow, in_use: Mapping[str, int]) -> str:
    """``2 of 3``: the live rows of the row's key (``in_use``: :func:`slots_in_use` of
    the key's rows) of the limit its grant recorded; ``-`` when not recorded."""
    return "-" if info.slots is None else f"{in_use.get(info.key, 0)} of {info.slots}"


def locks_table(infos: Sequence[LockInfo], *, with_state: bool = False) -> list[str]:
    """Lock rows in the columns of ``taskguard locks`` (plus STATE with ``with_state``:
    held, expired, or the kind of a live companion row: finished, pending, rate, debounce)."""
    headers = list(LOCKS_HEADERS) + (["STATE"] if with_state else [])
    in_use = slots_in_use(infos)
    rows = []
    for info in infos:
        h = info.holder
        row = [
            info.key,
            phase_text(info),
            str(info.slot),
            slots_text(info, in_use),
            str(info.token),
            _dash(h.task_name),
            _dash(h.hostname),
            _dash(h.pid),
            format_duration(info.held_for),
            format_duration(info.expires_in),
        ]
        if with_state:
            row.append((kind(info.key) or "held") if info.held else "expired")
        rows.append(row)
    return table(headers, rows)


def _when(value: datetime) -> str:
    return value.isoformat(sep=" ", timespec="milliseconds")


def _state(info: LockInfo, ending: LockEvent | None) -> str:
    if info.held:
        role = kind(info.key)
        return "held" if role is None else f"held ({KINDS[role]})"
    ago = format_duration(-info.expires_in)
    if ending is None:  # no history of it: a release and an expiry leave the same row
        return f"free, ended {ago} ago (released or expired; row not yet reaped)"
    how = EVENTS.get(ending.event, ending.event)
    return f"free, {how} {ago} ago{f' ({ending.detail})' if ending.detail else ''}"


def lock_details(
    info: LockInfo, ending: LockEvent | None = None, in_use: Mapping[str, int] | None = None
) -> str:
    """One lock row as ``name: value`` lines (``taskguard show``); ``ending``: how
    its lease ended, as the key's history tells it (:func:`taskguard.history.endings`);
    ``in_use``: :func:`slots_in_use` of the key's rows (default: this row's alone)."""
    h = info.holder
    fields = [
        ("key", info.key),
        ("slot", str(info.slot)),
        ("slots", slots_text(info, slots_in_use([info]) if in_use is None else in_use)),
        ("state", _state(info, ending)),
        ("phase", phase_text(info)),
        ("owner", info.owner),
        ("token", str(info.token)),
        ("task", _dash(h.task_name)),
        ("task id", _dash(h.task_id)),
        ("host", _dash(h.hostname)),
        ("pid", _dash(h.pid)),
        ("acquired", _when(info.acquired_at)),
        ("expires", _when(info.expires_at)),
        ("held for", format_duration(info.held_for)),
        ("expires in", format_duration(info.expires_in)),
    ]
    return "\n".join(f"{name + ':':<12}{printable(value)}" for name, value in fields)
