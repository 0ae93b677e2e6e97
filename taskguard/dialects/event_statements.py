"""The lock history's statements (``task_lock_events``), shared by every dialect
and compiled with the rest by :func:`taskguard.dialects.statements.build_lock_sql`:
recording an event, recording a grant (with ``taken_over`` for a previous grant that
ended without release), reading a key's story, trimming old events."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Float,
    String,
    bindparam,
    insert,
    literal,
    literal_column,
    or_,
    select,
    union_all,
)
from sqlalchemy.sql import func

from taskguard.dialects.base import EV, HOLDER_COLS, Flavor

__all__ = ["event_statements"]

_EVENT_COLS = ("at", "key", "slot", "event", "owner", "token", "duration", *HOLDER_COLS, "detail")
#: Events that end a grant: after one of them a takeover is not "taken_over".
_ENDINGS = ("released", "lost", "force_released", "reaped", "taken_over")


def event_statements(fl: Flavor) -> dict[str, Any]:
    """Lock history: recording events, reading a key's story, trimming old events."""
    now = fl.now
    event_values = {
        "at": now,
        **{col: bindparam(col) for col in ("key", "slot", "event", "owner", "token")},
        # Given (waited), or measured by the database clock from `since` (held).
        "duration": func.coalesce(
            bindparam("duration", type_=Float), fl.since(fl.ts_bind("since"))
        ),
        **{col: bindparam(col) for col in (*HOLDER_COLS, "detail")},
    }
    # A grant, plus "taken_over" for the slot's previous grant if that one ended
    # without release (its holder crashed, stalled or lost the lease). Both index
    # lookups walk (key, at) from the newest end.
    prev = (
        select(EV)
        .where(
            EV.c.key == bindparam("key"),
            EV.c.slot == bindparam("slot"),
            EV.c.event == literal_column("'acquired'"),
        )
        .order_by(EV.c.at.desc(), EV.c.id.desc())
        .limit(1)
        .subquery("p")
    )
    ended = EV.alias("e")
    taken_over = select(
        now,
        prev.c.key,
        prev.c.slot,
        literal("taken_over", String),
        prev.c.owner,
        prev.c.token,
        fl.since(prev.c.at),
        *(prev.c[col] for col in HOLDER_COLS),
        literal("lease expired without release; taken over by owner ", String)
        + bindparam("owner", type_=String),
    ).where(
        prev.c.owner != bindparam("owner"),
        ~select(ended.c.id)
        .where(
            ended.c.key == prev.c.key,
            ended.c.at >= prev.c.at,
            ended.c.owner == prev.c.owner,
            # Literals: a precompiled statement cannot expand an IN parameter.
            or_(*(ended.c.event == literal_column(f"'{e}'") for e in _ENDINGS)),
        )
        .exists(),
    )
    granted = select(*(event_values[col] for col in _EVENT_COLS))
    old = select(EV.c.id).where(EV.c.at < fl.plus("keep")).order_by(EV.c.at)
    return {
        "record_event": insert(EV).values(**event_values),
        "record_acquired": insert(EV).from_select(
            list(_EVENT_COLS), union_all(taken_over, granted)
        ),
        "events": select(*(EV.c[col] for col in ("id", *_EVENT_COLS)))
        .where(EV.c.key == bindparam("key"))
        .order_by(EV.c.at.desc(), EV.c.id.desc())
        .limit(bindparam("limit")),
        "trim_events": EV.delete().where(
            EV.c.id.in_(old.limit(bindparam("batch_size")).scalar_subquery())
        ),
    }
