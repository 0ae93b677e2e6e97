"""Lock rows, as the shared reads return them (``get``'s shape: the row, then the
database's ``read_at``), turned into :class:`~taskguard.lease.LockInfo` (the stored
phase as a :class:`~taskguard.options.Phase`)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from taskguard.lease import Holder, LockInfo
from taskguard.options import Phase

__all__ = ["decode", "live"]

#: A stored phase -> its value (one this version does not know reads as not recorded).
_PHASES: dict[str | None, Phase] = {str(p): p for p in Phase}


def decode(rows: list[tuple[Any, ...]], conv: Callable[[Any], datetime]) -> list[LockInfo]:
    """``conv``: the dialect's timestamp conversion."""
    return [
        LockInfo(
            key=r[0],
            slot=int(r[1]),
            owner=r[2],
            token=int(r[3]),
            acquired_at=conv(r[4]),
            expires_at=conv(r[5]),
            holder=Holder(task_name=r[6], task_id=r[7], hostname=r[8], pid=r[9]),
            read_at=conv(r[12]),
            phase=_PHASES.get(r[10]),
            slots=None if r[11] is None else int(r[11]),
        )
        for r in rows
    ]


def live(found: list[LockInfo], key: str | None) -> LockInfo | None:
    """Of ``key``'s rows, the live holder whose lease ends first (under a limit
    there may be several)."""
    held = [i for i in found if i.key == key and i.held]
    return min(held, key=lambda i: i.expires_at) if held else None
