"""PostgreSQL's acquire that also reads its refusal: when nothing was granted, the
same statement returns the key's rows (and the marker key's, for
``acquire_unless``), so a refused acquire, logged with its holder and returned by
:meth:`TaskGuard.try_acquire`, costs one round trip, not two. Used by the dialect
(:mod:`taskguard.dialects.postgresql`) for its full acquire: a data-modifying CTE
wrapped around the shared upsert.

Both parts see the statement's snapshot. A refusal decided by the acquire's read of
a live row therefore always finds that row. A refusal decided by the upsert's
takeover condition, on a row committed after the snapshot, may find only the older
version (ended, or no row at all): no live holder, and the caller reads the rows
afresh, as before. The holder read costs a grant nothing: its branch is skipped
once the CTE returned a row.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ColumnElement,
    bindparam,
    cast,
    exists,
    literal_column,
    null,
    select,
    union_all,
)

from taskguard.dialects.base import INFO_COLS, T

__all__ = ["granted_rows", "holder_rows", "reading_refusal"]

_ROW = (
    T.c.key,
    T.c.slot,
    T.c.owner,
    T.c.token,
    T.c.acquired_at,
    T.c.expires_at,
    *(T.c[c] for c in INFO_COLS),
)
#: Columns per row: the shared read's (``get``: the row, then ``read_at``).
ROW_WIDTH = len(_ROW) + 1


def reading_refusal(acquire: Any, now: ColumnElement[Any], unless: bool) -> Any:
    """``acquire`` (an ``INSERT … RETURNING token, acquired_at, expires_at``) as one
    statement whose rows are either the grant, in ``get``'s shape with NULL in every
    column but token, acquired_at and expires_at (key NULL tells it apart), or the
    rows of the key (and of ``:unless``) as ``get`` reads them."""
    got = acquire.cte("got")
    grant_cols = {"token": got.c.token, "acquired_at": got.c.acquired_at}
    grant_cols["expires_at"] = got.c.expires_at
    grant = select(
        *(grant_cols.get(c.name, cast(null(), c.type)).label(c.name) for c in _ROW),
        cast(null(), now.type).label("read_at"),
    )
    # One equality lookup per key (not key IN (...)): on a table that was tiny when
    # the statement was prepared, the IN form kept a sequential scan as its plan.
    keys = ["key", "unless"] if unless else ["key"]
    nothing_granted = ~exists(select(literal_column("1")).select_from(got))
    reads = (
        select(*_ROW, now.label("read_at")).where(T.c.key == bindparam(k), nothing_granted)
        for k in keys
    )
    return union_all(grant, *reads)


def granted_rows(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The grant among :func:`reading_refusal`'s rows, as ``(token, acquired_at,
    expires_at)``; the plain acquire's rows (sent instead where statements are not
    prepared) are in that shape already."""
    if rows and len(rows[0]) != ROW_WIDTH:
        return rows
    return [(r[3], r[4], r[5]) for r in rows if r[0] is None]


def holder_rows(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The key's (and the marker's) rows among :func:`reading_refusal`'s, in
    ``get``'s shape; none when the acquire was granted, or was the plain one."""
    return [r for r in rows if len(r) == ROW_WIDTH and r[0] is not None]
