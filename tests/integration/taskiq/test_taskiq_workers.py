"""taskguard.taskiq with real ``taskiq worker`` processes (issue 43).

The broker is taskiq-redis's ``ListQueueBroker`` (Redis database offset 5, a queue
per test): each message is one list item that exactly one worker pops, with no
redelivery, so a body that runs twice can only be taskguard's doing; its result
backend (``RedisAsyncResultBackend``) gives every kick's outcome back. Every body
that runs writes its own record (tiq_app.py).

Which scenario runs on which store:

- the storm (200 kicks over 5 keys, body 0.2 s, the run lock and the queue lock):
  PostgreSQL, MariaDB and SQLite;
- a worker SIGKILLed mid-run, a PostgreSQL outage during a run and during a send,
  a duplicate send refused, event-loop lag while 100 guarded tasks run: PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from taskguard import TaskGuard
from taskguard.exceptions import AlreadyLocked, DatabaseUnavailable
from taskguard.lease import is_skipped
from tests.harness.proxy import FaultProxy
from tests.services import redis_db

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

from tiq_app import build  # noqa: E402


class Workers:
    """Two ``taskiq worker`` processes (one child each) on a private queue."""

    def __init__(self, redis_url: str, database_url: str, records: Path) -> None:
        self.queue = f"tiq-{uuid.uuid4().hex[:10]}"
        self.redis_url, self.database_url, self.records = redis_url, database_url, records
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, count: int = 2) -> None:
        env = dict(os.environ)
        env.update({
            "TIQ_REDIS_URL": self.redis_url, "TIQ_QUEUE": self.queue,
            "TASKGUARD_DATABASE_URL": self.database_url, "TIQ_RECORDS": str(self.records),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")]),
        })  # fmt: skip
        for n in range(count):
            log = open(self.records.parent / f"worker{n}.log", "wb")  # noqa: SIM115
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "taskiq", "worker", "tiq_app:broker", "--workers", "1",
                 "--max-async-tasks", "150", "--shutdown-timeout", "2", "--log-level", "WARNING"],
                cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.records.parent.glob("worker*.log"))


@pytest.fixture
def records(tmp_path: Path) -> Path:
    path = tmp_path / "records"
    path.mkdir()
    return path


@contextlib.contextmanager
def running(database_url: str, records: Path, count: int = 2) -> Iterator[tuple[Workers, Any]]:
    workers = Workers(redis_db(5), database_url, records)
    app = build(workers.redis_url, workers.queue, database_url, records)
    workers.start(count)
    try:
        yield workers, app
    finally:
        workers.stop()


def read_records(records: Path, phase: str = "end") -> list[dict[str, Any]]:
    rows = []
    for path in records.glob("*.jsonl"):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line]
    return [r for r in rows if r["phase"] == phase]


def most_at_once(rows: list[dict[str, Any]]) -> dict[int, int]:
    """The most bodies of each key that overlapped in time."""
    by_key: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for r in rows:
        by_key[r["n"]] += [(r["start"], 1), (r["end"], -1)]
    most = {}
    for n, edges in by_key.items():
        now = peak = 0
        for _, step in sorted(edges, key=lambda e: (e[0], e[1])):  # an end before a start
            now += step
            peak = max(peak, now)
        most[n] = peak
    return most


async def outcomes(app: Any, handles: list[Any], timeout: float = 90) -> list[Any]:
    async def one(handle: Any) -> Any:
        result = await handle.wait_result(timeout=timeout, check_interval=0.1)
        assert not result.is_err, result.error
        return result.return_value

    return await asyncio.gather(*(one(h) for h in handles))


def test_storm(db_url: str, records: Path) -> None:
    """200 kicks over 5 keys (half the run lock, half the queue lock, sharing the
    keys), body 0.2 s: at most one body of a key at once; every kick ran once or was
    skipped (at its send or at its run), none twice, none lost."""

    async def storm(app: Any) -> tuple[list[Any], float]:
        await app.broker.startup()
        try:
            began = time.monotonic()
            handles = []
            for i in range(200):
                task = app.storm_run if i % 2 == 0 else app.storm_queue
                handles.append(await task.kiq(i, i % 5))
                if i % 40 == 39:
                    await asyncio.sleep(0.3)  # a storm in waves, so every key runs more than once
            return await outcomes(app, handles), time.monotonic() - began
        finally:
            await app.broker.shutdown()

    with running(db_url, records) as (workers, app):
        results, took = asyncio.run(storm(app))
    ran = [i for i, r in enumerate(results) if r == {"ran": i}]
    skipped = [i for i, r in enumerate(results) if is_skipped(r)]
    rows = read_records(records)
    bodies = sorted(r["i"] for r in rows)
    print(f"\nstorm on {make_url(db_url).get_backend_name()}: {len(ran)} ran, {len(skipped)} "
          f"skipped, {took:.1f} s")  # fmt: skip
    assert len(ran) + len(skipped) == 200, [r for r in results if r not in ran and not is_skipped(r)]
    assert bodies == ran  # each body that ran wrote one record; none ran twice
    assert set(most_at_once(rows).values()) == {1}, most_at_once(rows)
    assert len(ran) >= 10 and len(skipped) >= 10
    queue_skips = [r for r in results if is_skipped(r) and r["task"] == "storm_queue"]
    assert queue_skips, "no duplicate send was skipped"
