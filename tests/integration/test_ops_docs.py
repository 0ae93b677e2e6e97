"""Every ```sql block of docs/operations.md runs as-is in psql against a real,
populated PostgreSQL database, and the "who holds" queries find the holder."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from taskguard import TaskGuard

pytestmark = pytest.mark.postgres

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
EXAMPLE_KEY = "invoice:42"


def sql_blocks() -> list[str]:
    return re.findall(r"^```sql\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def psql_binary() -> str | None:
    found = shutil.which("psql")
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"), reverse=True)
    return str(candidates[0]) if candidates else None


def run_sql(url: str, sql: str) -> str:
    """Run ``sql`` exactly as written, through psql when available."""
    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    psql = psql_binary()
    if psql is None:  # pragma: no cover - no client tools; still prove the SQL runs
        with psycopg.connect(libpq, autocommit=True) as conn:
            cur = conn.execute(sql.encode())
            return repr(cur.fetchall() if cur.description else cur.rowcount)
    proc = subprocess.run(
        [psql, "-X", "-v", "ON_ERROR_STOP=1", "-d", libpq, "-f", "-"],
        input=sql,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, f"psql failed ({proc.returncode}):\n{sql}\n{proc.stderr}"
    assert "ERROR" not in proc.stderr, proc.stderr
    return proc.stdout


def test_the_doc_has_the_promised_queries() -> None:
    blocks = sql_blocks()
    assert len(blocks) >= 6
    text = "\n".join(blocks)
    assert "task_locks_held" in text
    assert EXAMPLE_KEY in text


def test_every_sql_block_runs_in_psql(pg_url: str) -> None:
    guard = TaskGuard(pg_url)
    try:
        lease = guard.acquire(EXAMPLE_KEY, 300, task_name="billing.charge", task_id="t-42")
        assert lease is not None
        assert guard.acquire("invoice:43", 300, task_name="billing.charge")
        assert guard.acquire("report:1", 300, task_name="reports.build", hostname="w2")
        assert guard.acquire("invoice:old", 0.001, task_name="billing.charge")
        blocks = sql_blocks()
        out = {block: run_sql(pg_url, block) for block in blocks}

        def output_of(*needles: str) -> str:
            [block] = [b for b in blocks if all(n in b for n in needles)]
            return out[block]

        # Who holds the key (view) / its row whatever its state: the owner shows up.
        who = output_of("FROM task_locks_held", f"key = '{EXAMPLE_KEY}'")
        assert lease.owner in who and "billing.charge" in who
        assert lease.owner in output_of("FROM task_locks\n", "expired_since")
        # Locks per task counts both live billing locks.
        per_task = output_of("coalesce(task_name", "GROUP BY 1")
        assert re.search(r"billing\.charge\s*\|\s*2\b", per_task), per_task
        # Expired-but-not-reaped: invoice:old is expired (but within the 300 s grace).
        counts = output_of("AS reapable")
        assert re.search(r"^\s*1\s*\|\s*0\s*\|", counts, flags=re.M), counts
        # The force-release UPDATE ended the lease.
        assert not guard.is_held_by(lease)
        info = guard.get(EXAMPLE_KEY)
        assert info is not None and not info.held
    finally:
        guard.dispose()
