"""taskguard through a real PgBouncer (Debian's package, a private process per test
session) in transaction pooling mode, ``default_pool_size = 5``.

* the shared API tests of test_guard/test_limits/test_fence/test_throttle, re-run
  here with ``db_url`` pointing through the pooler;
* a 16-process contended race checked by the chaos harness: 0 errors, 0 overlaps;
* the negative control: the same race with psycopg's server-side prepared statements
  switched back on (what taskguard did before issue 13) must fail.
"""

from __future__ import annotations

from typing import Any

import pytest
from pgbouncer_fixtures import (  # noqa: F401 - fixtures
    pgb_session_url,
    pgb_tx_url,
    pgbouncer_session,
    pgbouncer_tx,
)
from test_fence import (  # noqa: F401 - re-run through the pooler
    test_a_stale_holders_fenced_commit_fails,
    test_a_takeover_waits_for_the_fenced_transaction,
    test_fence_needs_a_session_or_connection,
    test_fence_returns_the_token_and_fails_once_released,
)
from test_guard import (  # noqa: F401 - re-run through the pooler
    test_acquire_conflict_then_release,
    test_adopt_hands_a_lease_over,
    test_awkward_keys_round_trip,
    test_conflict_is_logged_with_holder,
    test_expired_lease_cannot_be_renewed_or_released,
    test_held_prefix_get_and_force_release,
    test_lock_context_manager,
    test_renew_extends_by_database_clock,
    test_statements_never_join_the_callers_transaction,
    test_takeover_after_expiry_gets_higher_token,
    test_tokens_never_go_back_after_reaping,
)
from test_limits import (  # noqa: F401 - re-run through the pooler
    test_a_crashed_holder_frees_only_its_own_slot,
    test_every_slot_grant_gets_a_fresh_token,
    test_limit_never_exceeded_under_sixteen_processes,
    test_sixteen_processes_race_for_four_new_slots,
)
from test_throttle import (  # noqa: F401 - re-run through the pooler
    test_a_crashed_run_still_holds_its_window,
    test_one_run_per_window_across_processes,
    test_release_keeps_the_key_until_the_window_ends,
    test_renewals_never_shorten_the_window,
)

from scripts.chaoslib.contention import Plan, contention
from taskguard import Holder, Marker, TaskGuard
from taskguard.store import connections

pytestmark = pytest.mark.postgres


@pytest.fixture
def db_url(pgb_tx_url: str) -> str:  # noqa: F811 - overrides conftest's for this module
    """The shared tests' database, reached through PgBouncer (transaction pooling)."""
    return pgb_tx_url


def _race(url: str, **engine: object) -> dict[str, int]:
    plan = Plan(
        url=url,
        keys=("a", "b", "c"),
        grants=40,
        seconds=60,
        ttls=(0.005, 0.01, 0.02),
        engine_kwargs=engine or None,
    )
    rep = contention(plan, workers=16)
    counts = dict(rep.counts)
    counts["violations"] = rep.total_violations
    return counts


@pytest.mark.slow
def test_sixteen_processes_through_transaction_pooling(db_url: str) -> None:
    counts = _race(db_url)
    assert counts["violations"] == 0, counts
    assert counts.get("events.U", 0) == 0 and counts.get("events.E", 0) == 0, counts
    assert counts["grants"] == 16 * 40, counts


@pytest.mark.slow
def test_named_prepared_statements_fail_through_transaction_pooling(db_url: str) -> None:
    """Negative control: psycopg's default (prepare after 5 runs on a connection), as
    taskguard did before issue 13. The harness must see it fail."""
    counts = _race(db_url, connect_args={"prepare_threshold": 5})
    failed = counts["violations"] + counts.get("events.U", 0) + counts.get("events.E", 0)
    assert failed > 0, counts


# -- wait= (LISTEN) through the pooler --------------------------------------------------


def _wait_after_release(url: str, **kwargs: object) -> float:
    """Seconds from a release to the waiter's grant (waiter in a thread)."""
    import threading
    import time

    holder, waiter = TaskGuard(url), TaskGuard(url, **kwargs)  # type: ignore[arg-type]
    try:
        lease = holder.acquire("w", 30)
        assert lease is not None
        got: list[float] = []
        t = threading.Thread(target=lambda: got.append(_granted_at(waiter)))
        t.start()
        time.sleep(1.0)  # the waiter is queued (and, with LISTEN, listening)
        released = time.monotonic()
        assert holder.release(lease)
        t.join(30)
        assert got, "the waiter was never granted"
        return got[0] - released
    finally:
        holder.dispose()
        waiter.dispose()


def _granted_at(guard: TaskGuard) -> float:
    import time

    lease = guard.acquire("w", 30, wait=20)
    assert lease is not None
    return time.monotonic()


def test_wait_through_transaction_pooling_polls_and_says_so(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="taskguard"):
        latency = _wait_after_release(db_url)
    lines = [r.getMessage() for r in caplog.records if "connection pooler" in r.getMessage()]
    assert len(lines) <= 1 and (lines or _already_warned(db_url)), caplog.text
    # Polling backs off to 0.5 s at most (not RECHECK's 5 s); the rest is room for load.
    assert latency < 3.0, latency


def _already_warned(url: str) -> bool:
    from taskguard.dialects import postgresql_connections

    return any(url.rsplit("@", maxsplit=1)[-1] in u for u in postgresql_connections._warned_pooled)


def test_wait_with_a_direct_listen_url_is_woken_by_the_release(db_url: str, pg_url: str) -> None:
    latency = _wait_after_release(db_url, listen_url=pg_url)
    assert latency < 1.0, latency  # not RECHECK's 5 s; room for a loaded machine


# -- named statements only where nothing can hand them to another client ---------------


def _threshold(url: str) -> object:
    guard = TaskGuard(url)
    try:
        guard.db_now()
        with guard.engine.connect() as conn:
            return conn.connection.driver_connection.prepare_threshold  # type: ignore[union-attr]
    finally:
        guard.dispose()


def test_prepared_statements_only_on_direct_connections(db_url: str, pg_url: str) -> None:
    assert _threshold(pg_url) == 5  # direct: psycopg's default, a parse saved per statement
    assert _threshold(db_url) is None  # through PgBouncer: unnamed statements only


def test_a_refusal_behind_the_pooler_sends_the_plain_acquire_then_reads_the_holder(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unnamed statements are parsed and planned on every execution: the acquire
    that also reads its refusal costs a grant more there than the read it saves.
    (The lean acquire goes first, as on a direct connection.)"""
    sent: list[str] = []
    execute = connections._execute

    def counted(cur: Any, stmt: Any, params: Any, values: Any) -> Any:
        sent.append(stmt.sql.split()[0])
        return execute(cur, stmt, params, values)

    monkeypatch.setattr(connections, "_execute", counted)
    guard = TaskGuard(db_url)
    try:
        lease = guard.acquire("pooled:1", 30, task_name="import_feed", task_id="t1")
        assert lease is not None
        done = Marker("pooled:2:finished", 60, Holder(task_id="run-2"))
        sent.clear()
        attempt = guard.try_acquire("pooled:1", 30)
        assert attempt.holder is not None and attempt.holder.owner == lease.owner
        assert attempt.holder.holder.task_id == "t1"
        assert sent == ["INSERT", "INSERT", "SELECT"], sent
        other = guard.acquire("pooled:2", 30)
        assert other is not None and guard.release(other, marker=done)
        sent.clear()
        attempt = guard.try_acquire("pooled:2", 30, unless="pooled:2:finished")
        assert attempt.lease is None and attempt.holder is not None
        assert attempt.holder.holder.task_id == "run-2"
        assert sent == ["INSERT", "INSERT", "SELECT", "SELECT"], sent
    finally:
        guard.dispose()


# -- migrations, the start-up check, the reaper and the CLI through the pooler -----------


def test_upgrade_check_reap_and_cli_through_transaction_pooling(
    empty_pg_url: str,
    pgbouncer_tx: object,  # noqa: F811
) -> None:
    import os
    import subprocess
    import sys

    from taskguard import schema
    from taskguard.startup_check import check_database

    url = pgbouncer_tx.via(empty_pg_url)  # type: ignore[attr-defined]
    env = {**os.environ, "TASKGUARD_DATABASE_URL": url}
    cli = [sys.executable, "-c", "from taskguard.cli import main; main()"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cli, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )

    assert run("check").returncode == 1
    done = run("db", "upgrade")
    assert done.returncode == 0, done.stderr
    assert run("db", "upgrade").returncode == 0  # idempotent
    assert check_database(url).ok
    assert schema.current(url) == [schema.head()]
    guard = TaskGuard(url)
    try:
        for i in range(20):  # past psycopg's prepare threshold on every pooled connection
            lease = guard.acquire(f"r{i % 3}", 0.01)
            if lease is not None:
                guard.release(lease)
        import time

        time.sleep(0.05)
        assert guard.reap(grace=0) >= 1
        assert guard.reap(grace=0) == 0
    finally:
        guard.dispose()
    listed = run("locks", "--all")
    assert listed.returncode == 0, listed.stderr
    assert run("reap", "--grace", "0").returncode == 0


def test_relaxed_durability_never_leaks_to_other_clients_of_the_pooler(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import psycopg
    from sqlalchemy.engine import make_url

    with caplog.at_level("WARNING", logger="taskguard"):
        relaxed = TaskGuard(db_url, durable=False)
        try:
            assert relaxed.acquire("relaxed", 5) is not None
        finally:
            relaxed.dispose()
    assert "durable=False" in caplog.text and "ignored" in caplog.text
    libpq = make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    for _ in range(10):  # whichever server connection the pooler hands out
        with psycopg.connect(libpq, autocommit=True, prepare_threshold=None) as conn:
            row = conn.execute("SHOW synchronous_commit").fetchone()
            assert row == ("on",)
