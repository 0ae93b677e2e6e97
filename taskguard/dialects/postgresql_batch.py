"""PostgreSQL's batch grant: many grants in one statement (a Celery worker's main
process, :mod:`taskguard.celery.prefetched`). Part of the PostgreSQL dialect
(:mod:`taskguard.dialects.postgresql`), kept apart for size. (Many releases need no
statement of their own: they are the single release, pipelined.)

It takes a VALUES list, not unnest() of arrays: its row count is known when the
statement is prepared, so PostgreSQL keeps one generic plan (with arrays it plans
every execution again, ~0.5 ms of server CPU). Rows with a NULL key pad a list to
one of a few fixed lengths, so a connection prepares a handful of statements.
"""

__all__ = ["ACQUIRE_MANY", "ACQUIRE_MANY_ROW"]

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
