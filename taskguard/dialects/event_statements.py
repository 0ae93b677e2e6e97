"""The lock history's statements (``task_lock_events``), shared by every dialect
and compiled with the rest by :func:`taskguard.dialects.statements.build_lock_sql`:
recording an event, recording the end of a grant (named after the grant's holder),
reading a key's story, trimming old events.

Whether a grant was taken over is not decided when the next grant is recorded: the
end of the previous one may be written a fraction of a millisecond later, by its
holder. :func:`taskguard.history.story` decides it when the story is read."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Float,
    bindparam,
    insert,
    literal_column,
    select,
    true,
)
from sqlalchemy.sql import func

from taskguard.dialects.base import EV, HOLDER_COLS, Flavor

__all__ = ["KIND_SLOTS", "event_statements"]

#: Event kinds ``recent_events`` filters on at most (its unused slots repeat one).
KIND_SLOTS = 10

_EVENT_COLS = ("at", "key", "slot", "event", "owner", "token", "duration", *HOLDER_COLS, "detail")


def event_statements(fl: Flavor) -> dict[str, Any]:
    """Lock history: recording events, reading a key's story or every key's recent
    events (index (at) from :since, newest first), trimming old events."""
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
    # The end of a grant (released, lost) names the grant's holder: its owner's
    # `acquired` event, the first one at or after the grant (index (key, at) from
    # :since, the lease's acquired_at), unless the caller names the holder itself.
    grant = (
        select(*(EV.c[col] for col in HOLDER_COLS))
        .where(
            EV.c.key == bindparam("key"),
            EV.c.at >= fl.ts_bind("since"),
            EV.c.slot == bindparam("slot"),
            EV.c.owner == bindparam("owner"),
            EV.c.event == literal_column("'acquired'"),
        )
        .order_by(EV.c.at, EV.c.id)
        .limit(1)
        .subquery("g")
    )
    one = select(literal_column("1").label("one")).subquery("one")
    ended_values = {
        **event_values,
        **{
            col: func.coalesce(bindparam(col, type_=EV.c[col].type), grant.c[col])
            for col in HOLDER_COLS
        },
    }
    ended = select(*(ended_values[col] for col in _EVENT_COLS)).select_from(
        one.outerjoin(grant, true())
    )
    old = select(EV.c.id).where(EV.c.at < fl.plus("keep")).order_by(EV.c.at)
    return {
        "record_event": insert(EV).values(**event_values),
        "record_ended": insert(EV).from_select(list(_EVENT_COLS), ended),
        "events": select(*(EV.c[col] for col in ("id", *_EVENT_COLS)))
        .where(EV.c.key == bindparam("key"))
        .order_by(EV.c.at.desc(), EV.c.id.desc())
        .limit(bindparam("limit")),
        "recent_events": select(*(EV.c[col] for col in ("id", *_EVENT_COLS)))
        .where(
            EV.c.at >= fl.ts_bind("since"),
            EV.c.event.in_([bindparam(f"kind{i}") for i in range(KIND_SLOTS)]),
        )
        .order_by(EV.c.at.desc(), EV.c.id.desc())
        .limit(bindparam("limit")),
        "trim_events": EV.delete().where(
            EV.c.id.in_(old.limit(bindparam("batch_size")).scalar_subquery())
        ),
    }
