"""``taskguard demo``: run as a user would, from an installed package, and read its table.

The demo's verdict rests on its own measurement (start/end times recorded by
every run), so the measurement is checked too: without taskguard the same demo
must see a feed imported several times at once and exit 1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest
from conftest import AMQP_URL
from sqlalchemy import create_engine, text

from taskguard.demo.record import max_concurrency
from tests.services import redis_url

# A Redis database of its own: nothing another test left queued can reach the demo.
REDIS_BROKER_URL = redis_url(13)

REPO = Path(__file__).resolve().parents[2]
FEED_PREFIX = "https://example.com/feeds/"
# The demo's own deadline is ~30 s; this only stops a hung run from hanging CI.
HANG_GUARD = 180


def _table(stdout: str) -> tuple[dict[str, list[str]], list[str]]:
    """The final table: per-feed rows and the total row, split into cells."""
    rows = {}
    total = None
    for line in stdout.splitlines():
        cells = line.split()
        if cells and cells[0].startswith(FEED_PREFIX) and len(cells) >= 6 and cells[1].isdigit():
            rows[cells[0]] = cells
        elif cells[:1] == ["total"]:
            total = cells
    assert total is not None, f"no final table in:\n{stdout}"
    return rows, total


def _check_guarded_table(stdout: str, feeds: int, submissions: int) -> None:
    rows, total = _table(stdout)
    assert len(rows) == feeds, stdout
    for feed, cells in rows.items():
        submitted, ran, skipped, failed, at_once = map(int, cells[1:6])
        assert at_once == 1, f"{feed} ran {at_once} at once:\n{stdout}"
        assert failed == 0 and ran >= 1 and ran + skipped == submitted, stdout
        tokens = [int(t) for t in cells[6].split(",")] if len(cells) > 6 else []
        assert len(tokens) == ran and tokens == sorted(set(tokens)), (
            f"fencing tokens of {feed} must rise with every run: {tokens}"
        )
    assert int(total[1]) == submissions
    assert int(total[3]) > 0, "the demo is meant to show duplicates being skipped"
    assert "OK: no feed was imported twice at once" in stdout


def _demo(
    args: list[str], *, executable: list[str] | None = None, cwd: Path
) -> tuple[subprocess.CompletedProcess[str], float]:
    command = executable or [sys.executable, "-c", "from taskguard.cli import main; main()"]
    start = time.monotonic()
    run = subprocess.run(
        [*command, "demo", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=HANG_GUARD,
    )
    return run, time.monotonic() - start


def test_max_concurrency_counts_overlaps_not_touching_ends() -> None:
    assert max_concurrency([]) == 0
    assert max_concurrency([(0, 1), (1, 2), (2, 3)]) == 1  # back to back
    assert max_concurrency([(0, 2), (1, 3), (1.5, 1.6)]) == 3
    assert max_concurrency([(0, 10), (1, 2), (3, 4), (5, 6)]) == 2


@pytest.fixture(scope="module")
def installed_taskguard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install .`` of a clean copy of the repo into a fresh venv; returns the
    venv's ``taskguard`` script. Dependencies come from this environment (a plain
    path entry, so an editable taskguard here is not visible there)."""
    base = tmp_path_factory.mktemp("installed")
    src = base / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info", ".venv*")
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("taskguard", "migrations"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    dist = base / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(src),
        ],
        check=True,
        cwd=base,
    )
    wheel = next(dist.glob("taskguard_sql-*.whl"))
    assert any(n.startswith("taskguard/demo/") for n in zipfile.ZipFile(wheel).namelist())
    env_dir = base / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "deps.pth").write_text("\n".join(p for p in sys.path if p.endswith("-packages")))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            # A source tree on PYTHONPATH (its egg-info) otherwise reads as "already
            # installed with the same version" and the wheel is skipped.
            "--force-reinstall",
            str(wheel),
        ],
        check=True,
        cwd=base,
    )
    where = subprocess.run(
        [str(py), "-I", "-c", "import taskguard.demo; print(taskguard.demo.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=base,
    ).stdout.strip()
    assert where.startswith(str(env_dir)), where  # not the source tree, not the dev install
    return env_dir / "bin" / "taskguard"


@pytest.mark.slow
@pytest.mark.celery
def test_demo_from_an_installed_package(installed_taskguard: Path, tmp_path: Path) -> None:
    """The front door: `pip install . && taskguard demo`, from a directory with no
    repository files, on the embedded default (nothing else to set up)."""
    env = {k: v for k, v in os.environ.items() if k != "TASKGUARD_DATABASE_URL"}
    start = time.monotonic()
    run = subprocess.run(
        [str(installed_taskguard), "demo"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=HANG_GUARD,
    )
    elapsed = time.monotonic() - start
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    _check_guarded_table(run.stdout, feeds=5, submissions=120)
    out = run.stdout
    assert "sqla+sqlite:///" in out and "db+sqlite:///" in out and "threads pool" in out
    # The mid-run listing, in `taskguard locks` columns, shows live demo leases.
    assert "KEY" in out and "EXPIRES IN" in out and f"feed:{FEED_PREFIX}" in out
    assert "[" in out and "importing:" in out  # live progress lines
    assert list(tmp_path.iterdir()) == []  # its files went to a temp dir, now removed
    print(f"taskguard demo (installed wheel) took {elapsed:.1f}s")


@pytest.mark.slow
@pytest.mark.celery
def test_unguarded_demo_sees_overlaps_and_fails(tmp_path: Path) -> None:
    """Without taskguard the same measurement finds a feed running several times
    at once, so a 1 in the guarded table is a measured fact."""
    run, _ = _demo(
        ["--unguarded", "--feeds", "2", "--waves", "1", "--duplicates", "3"], cwd=tmp_path
    )
    assert run.returncode == 1, f"{run.stdout}\n{run.stderr}"
    rows, _ = _table(run.stdout)
    assert any(int(cells[5]) > 1 for cells in rows.values()), run.stdout
    assert "FAILED:" in run.stdout and "times at once" in run.stdout


@pytest.mark.slow
@pytest.mark.celery
@pytest.mark.postgres
@pytest.mark.parametrize("broker", [AMQP_URL, REDIS_BROKER_URL], ids=["rabbitmq", "redis"])
def test_demo_on_postgresql_and_a_broker(empty_pg_url: str, broker: str, tmp_path: Path) -> None:
    """The same demo on the production pieces: PostgreSQL and RabbitMQ or Redis; the
    tables it creates in the database it was given, it says it created."""
    pg_url = empty_pg_url
    run, _ = _demo(
        [
            "--database-url",
            pg_url,
            "--broker",
            broker,
            "--waves",
            "1",
            "--workdir",
            str(tmp_path / "files"),
        ],
        cwd=tmp_path,
    )
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    _check_guarded_table(run.stdout, feeds=5, submissions=30)
    assert "postgresql+psycopg://" in run.stdout
    assert "schema: created taskguard's tables in postgresql+psycopg://" in run.stdout
    # The locks really were rows in that database, all released by now.
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT count(*), count(*) FILTER (WHERE expires_at > now()) FROM task_locks WHERE key LIKE 'feed:%'"
            )
        ).one()
    engine.dispose()
    assert rows == (5, 0)
    # Every conflict was logged with its key and holder (kept with --workdir).
    log = (tmp_path / "files" / "demo.log").read_text()
    assert f"lock 'feed:{FEED_PREFIX}" in log and "is held by" in log


def test_demo_rejects_an_unreachable_broker_quickly(tmp_path: Path) -> None:
    run, _ = _demo(["--broker", "amqp://guest:guest@127.0.0.1:1//"], cwd=tmp_path)
    assert run.returncode == 2, f"{run.stdout}\n{run.stderr}"
    assert "broker amqp://guest:**@127.0.0.1:1// unreachable" in run.stderr


_WITHOUT_PACKAGING = """
import importlib.abc, sys

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "packaging":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Missing())
from taskguard.cli import main
main(sys.argv[1:])
"""


def test_demo_names_the_extra_when_a_transport_cannot_be_imported(tmp_path: Path) -> None:
    """Issue 27, item 6: after `pip install .` (no redis extra) `taskguard demo --broker
    redis://…` failed with "ModuleNotFoundError: No module named 'packaging'", which
    kombu's Redis transport imports. Here that module is made unimportable."""
    locks = tmp_path / "locks.sqlite"
    run = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PACKAGING, "demo", "--broker", REDIS_BROKER_URL,
         "--database-url", f"sqlite:///{locks}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=HANG_GUARD,
    )  # fmt: skip
    assert run.returncode == 2, f"{run.stdout}\n{run.stderr}"
    line = run.stderr.strip()
    assert "\n" not in line and line.startswith("taskguard: the redis:// broker needs"), line
    assert "No module named 'packaging'" in line and "pip install 'taskguard-sql[redis]'" in line
    assert not locks.exists()  # nothing was created before the refusal


def test_demo_lock_listing_escapes_control_characters() -> None:
    """The demo prints lock rows like ``taskguard locks``, with the same escaping."""
    from datetime import datetime, timedelta, timezone

    from taskguard.demo.show import locks_table
    from taskguard.lease import Holder, LockInfo

    now = datetime.now(timezone.utc)
    info = LockInfo(
        key="feed:a\nforged  0  1",
        slot=0,
        owner="o",
        token=1,
        acquired_at=now,
        expires_at=now + timedelta(seconds=60),
        holder=Holder(task_name="t\x1b[2J", hostname="h\r"),
        read_at=now,
    )
    lines = locks_table([info])
    assert len(lines) == 2 and "\n" not in "".join(lines)
    assert all(c.isprintable() for c in "".join(lines))
    assert lines[1].startswith("feed:a\\nforged  0  1") and "t\\x1b[2J" in lines[1]
