"""Concurrency-limit and waiter-reservation SQL (part of :mod:`taskguard.dialects`)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, and_, or_

from taskguard.dialects._parts import Flavor, T

__all__ = [
    "INSERT_COLS",
    "PG_ACQUIRE_SLOTS",
    "SQLITE_ACQUIRE_SLOTS",
    "TAKEOVER_SET",
    "free",
    "free_sql",
]

_t = T


def free(fl: Flavor, owner: ColumnElement[Any]) -> ColumnElement[bool]:
    """The row's lease ended and it is not reserved for another waiter."""
    return and_(
        _t.c.expires_at <= fl.now,
        or_(
            _t.c.next_owner.is_(None),
            _t.c.next_owner == owner,
            _t.c.next_owner == _t.c.owner,  # the reserved waiter got it: used up
            _t.c.next_until <= fl.now,
            _t.c.expires_at <= fl.grace_ago,
        ),
    )


def free_sql(fl: Flavor, row: str, owner: str) -> str:
    """:func:`_free` as text, for the statements written as text."""
    return (
        f"{row}.expires_at <= {fl.now_sql} AND ({row}.next_owner IS NULL"
        f" OR {row}.next_owner = {owner} OR {row}.next_owner = {row}.owner"
        f" OR {row}.next_until <= {fl.now_sql} OR {row}.expires_at <= {fl.grace_ago_sql})"
    )


INSERT_COLS = "key, slot, owner, token, acquired_at, expires_at, task_name, task_id, hostname, pid"
TAKEOVER_SET = (
    "owner = excluded.owner, token = {token}, acquired_at = excluded.acquired_at, "
    "expires_at = excluded.expires_at, task_name = excluded.task_name, "
    "task_id = excluded.task_id, hostname = excluded.hostname, pid = excluded.pid"
)

# Concurrency limit, PostgreSQL. Prefer an expired row nobody else is claiming
# (SKIP LOCKED spreads concurrent acquirers over different rows), else a slot that
# has no row yet (picked at random to make collisions unlikely). A collision on a
# new slot loses the INSERT race: then `pick` has a row but `won` has none, which
# the caller reads as "retry once" rather than as a conflict.
PG_ACQUIRE_SLOTS = """
WITH expired AS MATERIALIZED (
    SELECT slot FROM task_locks AS t
    WHERE t.key = :key AND t.slot < :n AND {free_t}
    ORDER BY t.slot LIMIT 1
    FOR UPDATE SKIP LOCKED
), pick AS MATERIALIZED (
    SELECT c.slot FROM (
        SELECT slot, 0 AS pref FROM expired
        UNION ALL
        SELECT s.slot, 1 FROM generate_series(0, :n - 1) AS s(slot)
        WHERE NOT EXISTS (SELECT 1 FROM task_locks AS e WHERE e.key = :key AND e.slot = s.slot)
    ) AS c
    ORDER BY c.pref, random() LIMIT 1
), won AS (
    INSERT INTO task_locks AS task_locks ({cols})
    SELECT :key, pick.slot, :owner, nextval('task_locks_token_seq'), {now}, {plus_ttl},
           :task_name, :task_id, :hostname, :pid
    FROM pick
    ON CONFLICT (key, slot) DO UPDATE SET {takeover}
    WHERE {free_row}
    RETURNING task_locks.slot, task_locks.token, task_locks.acquired_at, task_locks.expires_at
)
SELECT pick.slot, won.token, won.acquired_at, won.expires_at FROM pick LEFT JOIN won ON true
"""

# Concurrency limit, SQLite: one writer at a time, so the lowest free slot is exact.
SQLITE_ACQUIRE_SLOTS = """
WITH RECURSIVE s(slot) AS (SELECT 0 UNION ALL SELECT slot + 1 FROM s WHERE slot + 1 < :n)
INSERT INTO task_locks ({cols})
SELECT :key, s.slot, :owner, (SELECT value + 1 FROM {counter}), {now}, {plus_ttl},
       :task_name, :task_id, :hostname, :pid
FROM s
WHERE NOT EXISTS (
    SELECT 1 FROM task_locks AS t WHERE t.key = :key AND t.slot = s.slot AND NOT ({free_t})
)
ORDER BY s.slot LIMIT 1
ON CONFLICT (key, slot) DO UPDATE SET {takeover}
WHERE {free_row}
RETURNING slot, token, acquired_at, expires_at
"""
