"""PostgreSQL's batch statements: many grants, or many releases, in one statement
(a Celery worker's main process, :mod:`taskguard.celery.prefetched`). Part of the
PostgreSQL dialect (:mod:`taskguard.dialects.postgresql`), kept apart for size.

Both take a VALUES list, not unnest() of arrays: its row count is known when the
statement is prepared, so PostgreSQL keeps one generic plan (with arrays it plans
every execution again, ~0.5 ms of server CPU). Rows with a NULL key pad a list to
one of a few fixed lengths, so a connection prepares a handful of statements.
"""

__all__ = ["ACQUIRE_MANY", "ACQUIRE_MANY_ROW", "RELEASE_MANY", "RELEASE_MANY_ROW"]

#: Many single-slot grants: the acquire of acquire_unless for each row. One round
#: trip and one (durable) commit; each key once (one statement cannot upsert a row
#: twice). Returns the granted rows only.
#: OFFSET 0 keeps each NOT EXISTS a per-row index lookup: as a join, a plan made
#: while the table was small hashes a full scan of it, kept as the table grows.
ACQUIRE_MANY = """
INSERT INTO task_locks AS task_locks ({cols})
SELECT v.key, 0, v.owner, nextval('task_locks_token_seq'), {now},
       {now} + v.ttl * interval '1 second', v.task_name, v.task_id, v.hostname, v.pid
FROM (VALUES {{rows}}) AS v(key, owner, ttl, task_name, task_id, hostname, pid, unless)
WHERE v.key IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM task_locks AS cur
                  WHERE cur.key = v.key AND cur.slot = 0 AND NOT ({free_many}) OFFSET 0)
  AND NOT EXISTS (SELECT 1 FROM task_locks AS marker
                  WHERE marker.key = v.unless AND marker.expires_at > {now} OFFSET 0)
ON CONFLICT (key, slot) DO UPDATE SET {takeover}
WHERE {free_row}
RETURNING task_locks.key, task_locks.owner, task_locks.token,
          task_locks.acquired_at, task_locks.expires_at
"""
ACQUIRE_MANY_ROW = (
    "(:key_{i}, :owner_{i}, CAST(:ttl_{i} AS float8), :task_name_{i}, :task_id_{i},"
    " :hostname_{i}, CAST(:pid_{i} AS integer), :unless_{i})"
)

#: Many releases, each taking its marker key (if any) like release_marking does:
#: the markers first, in a data-modifying CTE, then the releases by owner. One round
#: trip; committed without waiting for the WAL flush, like a single release. Each
#: marker key once (one statement cannot upsert a row twice). Returns the released
#: (key, owner) pairs.
RELEASE_MANY = """
WITH v(key, owner, mark_key, mark_owner, mark_ttl, task_name, task_id, hostname, pid) AS (
    VALUES {{rows}}
), marked AS (
    INSERT INTO task_locks AS task_locks ({cols})
    SELECT v.mark_key, 0, v.mark_owner, nextval('task_locks_token_seq'), {now},
           {now} + v.mark_ttl * interval '1 second', v.task_name, v.task_id, v.hostname, v.pid
    FROM v WHERE v.mark_key IS NOT NULL
    ON CONFLICT (key, slot) DO UPDATE SET {takeover}
    WHERE {free_row}
)
UPDATE task_locks SET expires_at = {now}
FROM v
WHERE task_locks.key = v.key AND task_locks.slot = 0 AND task_locks.owner = v.owner
  AND task_locks.expires_at > {now}
  AND set_config('synchronous_commit', 'off', true) IS NOT NULL
RETURNING task_locks.key, task_locks.owner
"""
RELEASE_MANY_ROW = (
    "(:key_{i}, :owner_{i}, :mark_key_{i}, :mark_owner_{i}, CAST(:mark_ttl_{i} AS float8),"
    " :task_name_{i}, :task_id_{i}, :hostname_{i}, CAST(:pid_{i} AS integer))"
)
