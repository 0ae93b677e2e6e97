"""A refused acquire and the holder it reports: right on every database, and read
by the acquire statement itself on PostgreSQL (one round trip per refusal, which is
what a duplicate storm is made of)."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from taskguard import Holder, Marker, TaskGuard
from taskguard.store import connections


def statement_names(guard: TaskGuard) -> dict[int, str]:
    """The guard's compiled statements by identity: their ``LockSQL`` field names
    (``acquire.unprepared`` for the form sent where statements are not prepared)."""
    sql = guard._store._sql
    names = {id(v): f for f in type(sql).__dataclass_fields__ if (v := getattr(sql, f)) is not None}
    for field in ("acquire", "acquire_unless"):
        stmt = getattr(sql, field)
        if stmt is not None and stmt.unprepared is not None:
            names[id(stmt.unprepared)] = f"{field}.unprepared"
    return names


def _counting(guard: TaskGuard) -> list[str]:
    """The name of every statement the guard sends from now on."""
    sent: list[str] = []
    run = guard._store._db.run
    names = statement_names(guard)

    def counted(stmt: Any, values: dict[str, Any], deadline: float | None = None) -> Any:
        sent.append(names.get(id(stmt), stmt.sql.split()[0].upper()))
        return run(stmt, values, deadline)

    guard._store._db.run = guard._store.run = counted  # type: ignore[method-assign]
    return sent


#: What a refused acquire sends, by dialect: PostgreSQL reads the holder in its full
#: acquire statement (a data-modifying CTE), sent after the lean one grants nothing,
#: and at once for a key refused before; MariaDB in its upsert's RETURNING; SQLite
#: with a statement of its own.
FIRST_REFUSAL = {
    "postgresql": ["acquire_lean", "acquire"],
    "mysql": ["acquire"],
    "sqlite": ["acquire", "get"],
}
LATER_REFUSAL = {**FIRST_REFUSAL, "postgresql": ["acquire"]}


def test_refusal_reports_the_holder(guard: TaskGuard) -> None:
    lease = guard.acquire("feed:1", 30, task_name="import_feed", task_id="t1", pid=7)
    assert lease is not None
    sent = _counting(guard)
    for expected in (FIRST_REFUSAL, LATER_REFUSAL):
        sent.clear()
        attempt = guard.try_acquire("feed:1", 30, task_name="import_feed", task_id="t2")
        assert attempt.lease is None and attempt.holder is not None
        assert (attempt.holder.owner, attempt.holder.token) == (lease.owner, lease.token)
        assert (attempt.holder.holder.task_id, attempt.holder.holder.pid) == ("t1", 7)
        assert attempt.holder.held and attempt.holder.expires_at == lease.expires_at
        assert sent == expected[guard.dialect_name], sent


def test_refusal_by_a_marker_reports_the_marker(guard: TaskGuard) -> None:
    """``unless=``: the key itself is free, the marker's row is the holder."""
    lease = guard.acquire("job:1", 30)
    assert lease is not None
    done = Marker("job:1:finished", 60, Holder(task_name="job", task_id="run-1"))
    assert guard.release(lease, marker=done)
    sent = _counting(guard)
    attempt = guard.try_acquire("job:1", 30, unless="job:1:finished")
    assert attempt.lease is None and attempt.holder is not None
    assert attempt.holder.key == "job:1:finished"
    assert attempt.holder.holder.task_id == "run-1"
    # Elsewhere the marker is checked before the acquire (MariaDB) or in it (SQLite).
    expected = {
        "postgresql": ["acquire_unless_lean", "acquire_unless"],
        "mysql": ["get", "get"],
        "sqlite": ["acquire_unless", "get", "get"],
    }
    assert sent == expected[guard.dialect_name], sent


def test_a_grant_reads_no_holder(guard: TaskGuard) -> None:
    sent = _counting(guard)
    attempt = guard.try_acquire("free", 30)
    assert attempt.lease is not None and attempt.holder is None
    assert sent == ["acquire_lean" if guard.dialect_name == "postgresql" else "acquire"]
    info = guard.get("free")
    assert info is not None and info.token == attempt.lease.token
    # A key refused before goes to the full statement at once, which grants as well.
    sent.clear()
    assert guard.try_acquire("free", 30).lease is None
    assert guard.release(attempt.lease)
    again = guard.try_acquire("free", 30)
    assert again.lease is not None and again.lease.token > attempt.lease.token
    assert sent[-1] == "acquire", sent


def test_refusal_with_min_hold_reads_the_holder_in_the_same_statement(
    pg_guard: TaskGuard,
) -> None:
    lease = pg_guard.acquire("throttled", 30, min_hold=5)
    assert lease is not None
    sent = _counting(pg_guard)
    attempt = pg_guard.try_acquire("throttled", 30, min_hold=5)
    assert attempt.lease is None and attempt.holder is not None
    assert attempt.holder.owner == lease.owner
    assert sent == ["acquire_lean", "acquire"], sent


def test_the_lean_acquire_leaves_a_reserved_row_to_the_full_rules(pg_guard: TaskGuard) -> None:
    """A row a waiter has reserved is never granted by the lean statement, to anyone
    (whatever the clock says about the reservation): the full one decides. Once the
    waiter's grant used the reservation up, the lean statement grants again."""
    lease = pg_guard.acquire("reserved", 30)
    assert lease is not None
    store = pg_guard._store
    waiter_id = "w" * 32
    rows, _ = store.waiters.announce("reserved", range(0, 1), waiter_id, None, 30.0)
    assert rows and rows[0][3] == waiter_id  # next in line
    assert pg_guard.release(lease)
    holder = Holder(task_name="waiter", hostname=pg_guard.hostname, pid=1)
    lean = store._sql.acquire_lean
    assert lean is not None
    for owner in ("n" * 32, waiter_id):  # a newcomer, the waiter itself
        values = store.grant_values("reserved", 0, owner, 30.0, holder)
        assert store.run(lean, values) == ([], 0)
    sent = _counting(pg_guard)
    values = store.grant_values("reserved", 0, waiter_id, 30.0, holder)
    waiter, _ = store.grant_seeing(values, 30.0)
    assert waiter is not None and waiter.token > lease.token
    assert sent == ["acquire_lean", "acquire"], sent
    assert store.rows("reserved")[0].owner == waiter_id
    assert pg_guard.release(waiter)
    sent.clear()
    other = TaskGuard(pg_guard.engine.url.render_as_string(hide_password=False))
    try:
        sent_by_other = _counting(other)
        assert other.acquire("reserved", 30) is not None
        assert sent_by_other == ["acquire_lean"], sent_by_other
    finally:
        other.dispose()


@pytest.mark.parametrize("contended", [True, False], ids=["full-first", "lean-first"])
def test_holder_committed_after_the_statements_snapshot_is_read_afresh(
    pg_url: str, pg_guard: TaskGuard, contended: bool
) -> None:
    """The acquire's snapshot shows the row ended, so it tries the takeover; the row
    was taken meanwhile (committed while the acquire waited for its row lock), so the
    takeover condition refuses. The full statement's holder branch sees only the ended
    version: the guard reads the rows again and reports the new holder, never the old
    one. The lean statement (sent first for a key not refused before) refuses the
    same way, and the full one after it sees the new holder."""
    old = pg_guard.acquire("race", 0.05, task_name="old")
    assert old is not None
    time.sleep(0.1)
    libpq = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    winner = psycopg.connect(libpq)  # a transaction: holds the row lock until commit
    winner.execute(
        "UPDATE task_locks SET owner = 'winner', task_name = 'new', token = token + 1000, "
        "acquired_at = statement_timestamp(), "
        "expires_at = statement_timestamp() + interval '60 seconds' WHERE key = 'race'"
    )
    victim = TaskGuard(pg_url)
    if contended:
        victim._store._contended.add("race")
    sent = _counting(victim)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(a=victim.try_acquire("race", 30)))
    thread.start()
    try:
        with psycopg.connect(libpq, autocommit=True) as admin:
            for _ in range(250):
                if admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                ).fetchone():
                    break
                time.sleep(0.02)
            else:
                pytest.fail("the acquire never waited for the row lock")
        winner.commit()
        thread.join(30)
    finally:
        winner.close()
        victim.dispose()
    attempt = result["a"]
    assert attempt.lease is None and attempt.holder is not None
    assert (attempt.holder.owner, attempt.holder.holder.task_name) == ("winner", "new")
    assert sent == (["acquire", "get"] if contended else ["acquire_lean", "acquire"]), sent


@pytest.mark.parametrize(
    "field", ["acquire", "acquire_unless", "acquire_lean", "acquire_unless_lean"]
)
def test_the_acquire_plan_is_index_lookups_even_when_made_on_a_small_table(
    pg_guard: TaskGuard, pg_url: str, field: str
) -> None:
    # PostgreSQL keeps the generic plan of a prepared statement, made while the table
    # was small: a sequential scan chosen then is scanned on every refusal as the
    # table grows (until an ANALYZE makes it plan again).
    for i in range(5):
        pg_guard.acquire(f"small:{i}", 30)
    stmt = getattr(pg_guard._store._sql, field)
    assert stmt is not None
    names = list(stmt.positional_names or ())  # the statement takes them by position
    positions = iter(range(1, len(names) + 1))
    numbered = re.sub(r"%s", lambda _m: f"${next(positions)}", stmt.sql).replace("%%", "%")
    sample = {"key": "'k'", "slot": "0", "owner": "'o'", "ttl": "60", "pid": "1", "unless": "'u'"}
    args = ", ".join(sample.get(name, "NULL") for name in names)
    libpq = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE acquire AS {numbered}")
        conn.execute("BEGIN")
        plan = "\n".join(r[0] for r in conn.execute(f"EXPLAIN EXECUTE acquire({args})"))
        conn.execute("ROLLBACK")
    assert "Seq Scan" not in plan, plan


@pytest.mark.parametrize("prepares", [True, False], ids=["prepared", "never"])
def test_a_connection_that_never_prepares_sends_the_plain_acquire(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, prepares: bool
) -> None:
    """Parsed and planned on every execution, the longer statement costs a grant
    more than the read it saves a refusal (behind a pooler: test_pgbouncer.py)."""
    sent: list[str] = []
    execute = connections._execute
    guard = TaskGuard(pg_url, connect_args={"prepare_threshold": 5 if prepares else 2**31 - 1})
    names = statement_names(guard)

    def counted(cur: Any, stmt: Any, params: Any, values: Any) -> Any:
        sent.append(names[id(stmt)])
        return execute(cur, stmt, params, values)

    monkeypatch.setattr(connections, "_execute", counted)
    try:
        lease = guard.acquire("unnamed", 30, task_id="t1")
        assert lease is not None
        attempt = guard.try_acquire("unnamed", 30)
        assert attempt.holder is not None and attempt.holder.holder.task_id == "t1"
    finally:
        guard.dispose()
    refusal = ["acquire"] if prepares else ["acquire.unprepared", "get"]
    assert sent == ["acquire_lean", "acquire_lean", *refusal], sent
