"""taskguard through a real PgBouncer in *session* pooling mode (issue 13).

Session pooling gives each client one server connection for as long as it stays
connected, so named prepared statements and LISTEN would work; taskguard cannot
tell it from transaction pooling (both hide the backend pid), so it treats it the
same way: unnamed statements, and waiters poll unless ``listen_url`` is set, which
may name this very pooler. The shared API tests re-run here, plus a 16-process race,
the Celery finished-record statements, the CLI and waiting.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pgbouncer_fixtures import pgb_session_url, pgbouncer_session  # noqa: F401 - fixtures
from test_guard import (  # noqa: F401 - re-run through the pooler
    test_acquire_conflict_then_release,
    test_adopt_hands_a_lease_over,
    test_conflict_is_logged_with_holder,
    test_expired_lease_cannot_be_renewed_or_released,
    test_held_prefix_get_and_force_release,
    test_renew_extends_by_database_clock,
    test_statements_never_join_the_callers_transaction,
    test_takeover_after_expiry_gets_higher_token,
    test_tokens_never_go_back_after_reaping,
)
from test_limits import (  # noqa: F401 - re-run through the pooler
    test_every_slot_grant_gets_a_fresh_token,
    test_limit_never_exceeded_under_sixteen_processes,
)
from test_markers import (  # noqa: F401 - re-run through the pooler
    test_a_marker_refuses_the_acquire_it_names,
    test_the_marker_is_taken_even_when_the_lease_was_lost,
)
from test_pgbouncer import _race, _threshold, _wait_after_release

pytestmark = pytest.mark.postgres


@pytest.fixture
def db_url(pgb_session_url: str) -> str:  # noqa: F811 - overrides conftest's for this module
    """The shared tests' database, reached through PgBouncer (session pooling)."""
    return pgb_session_url


@pytest.mark.slow
def test_sixteen_processes_through_session_pooling(db_url: str) -> None:
    counts = _race(db_url)
    assert counts["violations"] == 0, counts
    assert counts.get("events.U", 0) == 0 and counts.get("events.E", 0) == 0, counts
    assert counts.get("events.G", 0) > 0, counts


def test_unnamed_statements_through_session_pooling(db_url: str) -> None:
    assert _threshold(db_url) is None  # a pooler is a pooler: never assume a session


def test_wait_through_session_pooling_polls(db_url: str) -> None:
    # Polling backs off to 0.5 s at most (not RECHECK's 5 s); the rest is room for load.
    assert _wait_after_release(db_url) < 3.0


def test_wait_listening_through_the_session_pooler(db_url: str) -> None:
    # listen_url may name a session-pooled URL: LISTEN keeps its server connection.
    # Woken by the release, not by RECHECK (5 s); 0.1 s failed at a load of 15 (0.18 s).
    assert _wait_after_release(db_url, listen_url=db_url) < 1.0


def test_cli_through_session_pooling(db_url: str) -> None:
    env = {**os.environ, "TASKGUARD_DATABASE_URL": db_url}
    cli = [sys.executable, "-c", "from taskguard.cli import main; main()"]
    for args in (["check"], ["db", "upgrade"], ["locks", "--all"], ["reap", "--grace", "0"]):
        done = subprocess.run(
            [*cli, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, (args, done.stdout, done.stderr)
