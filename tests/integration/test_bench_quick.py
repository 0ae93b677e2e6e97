"""SLOW (about 1-2 minutes): runs ``scripts/bench.py --quick`` end to end.

The benchmark's figures are not asserted (they depend on the machine and its load);
this checks that every section runs against the real services (section 7 against
the private PostgreSQL and Redis servers it starts) and that every row is
reported, either with figures or with the reason it was not run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import AMQP_URL, PG_URL, REDIS_URL

from tests.services import REDIS_BASE

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.celery]


def _expected_rows() -> list[str]:
    listed = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench.py"), "--rows"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return listed.stdout.split()


@pytest.mark.timeout(960)
def test_quick_benchmark_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "bench.py"),
            "--quick",
            "--json",
            str(out),
            "--pg-url",
            PG_URL,
            "--redis-url",
            REDIS_URL,
            "--amqp-url",
            AMQP_URL,
        ],
        cwd=REPO,
        # The storm section's lock keys in a Redis database no other test empties
        # (tests/services.py: database 3 of the suite's).
        env={**os.environ, "TGBENCH_STORM_REDIS_DB": str(REDIS_BASE + 3)},
        capture_output=True,
        text=True,
        timeout=900,  # 1-2 minutes alone; over 6 on a 2-core machine at a load of 15-20
    )
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["id"] for r in rows] == _expected_rows()
    for row in rows:
        assert row["status"] == "ok" or row["status"].startswith("not run: "), row
        if row["status"] == "ok":
            assert row["rate"] is not None and row["rate"] > 0, row
        assert row["label"] in proc.stdout, f"row {row['id']} missing from the printed table"
    assert {t["target"] for t in data["targets"]} and all("met" in t for t in data["targets"])
    # The deployment-shaped section (its own servers on one core, clients on the other)
    # must run wherever there are two cores to split.
    if len(os.sched_getaffinity(0)) >= 2:
        split = [r for r in rows if r["id"].startswith("split.")]
        assert split and all(r["status"] == "ok" for r in split), split
    meta = data["meta"]
    assert (
        meta["quick"] is True and meta["machine"]["cores"] and meta["postgresql"]["server_version"]
    )
