"""``taskguard release`` and ``taskguard reap``, run as real subprocesses against
real databases (cli_runner.py)."""

from __future__ import annotations

import pytest
from cli_runner import TASKGUARD, env, guard, lock_url, run, tg, url  # noqa: F401 - fixtures
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from taskguard import TaskGuard

pytestmark = pytest.mark.postgres


# -- release -------------------------------------------------------------------------------


def test_release_by_owner(guard: TaskGuard, env: dict[str, str]) -> None:
    lease = guard.acquire("job:1", 300)
    assert lease is not None
    proc = run([*TASKGUARD, "release", "job:1", "--owner", "someone-else"], env, code=1)
    assert "not held by owner someone-else" in proc.stderr and lease.owner in proc.stderr
    assert guard.is_held_by(lease)
    assert "released 'job:1'" in tg("release", "job:1", "--owner", lease.owner, env=env)
    assert not guard.is_held_by(lease)
    run([*TASKGUARD, "release", "job:1", "--owner", lease.owner], env, code=1)
    run([*TASKGUARD, "release", "job:1"], env, code=2)
    run([*TASKGUARD, "release", "job:1", "--owner", lease.owner, "--force"], env, code=2)


def test_force_release_asks_unless_yes(guard: TaskGuard, env: dict[str, str]) -> None:
    lease = guard.acquire("job:2", 300, task_name="stuck.task")
    assert lease is not None
    # No terminal, no answer: nothing happens, exit 2.
    proc = run([*TASKGUARD, "release", "job:2", "--force"], env, code=2)
    assert "pass --yes" in proc.stderr
    assert guard.is_held_by(lease)
    # Declined.
    run([*TASKGUARD, "release", "job:2", "--force"], env, input="n\n", code=1)
    assert guard.is_held_by(lease)
    # Confirmed interactively.
    assert "force-released 'job:2'" in tg("release", "job:2", "--force", input="y\n", env=env)
    assert not guard.is_held_by(lease)
    assert not guard.renew(lease)  # the old holder finds out at its next renewal
    # --yes skips the question.
    lease = guard.acquire("job:2", 300)
    assert lease is not None
    done = run([*TASKGUARD, "release", "job:2", "--force", "--yes"], env)
    assert done.stdout.startswith("force-released 'job:2'")
    assert done.stderr == ""  # said once (it was also on stderr, from the library's log)
    assert not guard.is_held_by(lease)
    proc = run([*TASKGUARD, "release", "job:2", "--force", "--yes"], env, code=1)
    assert "'job:2' is not held" in proc.stderr


# -- reap ----------------------------------------------------------------------------------


_OLD_ROWS = {
    "postgresql": "INSERT INTO task_locks (key, slot, owner, token, acquired_at, expires_at) "
    "SELECT 'old:' || g, 0, md5(g::text), nextval('task_locks_token_seq'), "
    "now() - interval '2 hours', now() - interval '1 hour' "
    "FROM generate_series(1, 2500) g",
    "mysql": "INSERT INTO task_locks (`key`, slot, owner, token, acquired_at, expires_at) "
    "SELECT CONCAT('old:', seq), 0, md5(seq), NEXT VALUE FOR task_locks_token_seq, "
    "UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR "
    "FROM seq_1_to_2500",
}


def test_reap_with_progress(url: str, guard: TaskGuard, env: dict[str, str]) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(_OLD_ROWS[engine.dialect.name])
    engine.dispose()
    live = guard.acquire("live", 300)
    assert live is not None
    proc = run([*TASKGUARD, "reap", "--batch-size", "500", "--grace", "60"], env)
    assert proc.stdout.startswith(
        f"removed 2500 expired lock row(s) from {make_url(url).drivername}://"
    )
    assert ":***@" in proc.stdout
    assert "reap: " in proc.stderr and "removed so far" in proc.stderr
    assert guard.is_held_by(live)
    proc = run([*TASKGUARD, "reap"], env)
    assert proc.stdout.startswith("removed 0 ")
    assert proc.stderr == ""
    proc = run([*TASKGUARD, "reap", "--batch-size", "0"], env, code=2)
    assert "--batch-size" in proc.stderr
