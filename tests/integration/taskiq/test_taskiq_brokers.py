"""taskguard.taskiq on a broker that redelivers, and a send cancelled mid-way (issue 43).

The broker is taskiq-redis's ``RedisStreamBroker`` on a private Redis server: a
message is acked once its result is saved; one left unacked for ``IDLE_MS`` (4 s) is
claimed by a worker and delivered again. Two ``taskiq worker`` processes for the
module (taskiq restarts a child that was killed), PostgreSQL for the locks; the app
is tiq_meet.py. Each scenario kills at most one worker child:

- a finished message delivered again (its ack lost with its worker) does not run again;
- a worker SIGKILLed mid-run (ttl 2 s): its message, delivered again, runs once the
  key is free, and the history says the dead run's lease was taken over;
- a ``kiq`` with the queue lock cancelled while its acquire waits: no lease is left
  and nothing is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from taskguard import TaskGuard
from taskguard.config import reset_guards
from taskguard.results import is_skipped
from tests.services import libpq, pg_database_and_private_redis

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

from test_taskiq_workers import read_records, started, wait_for  # noqa: E402
from tiq_meet import build  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Meet:
    """The module's two workers, its stream, lock database and records."""

    def __init__(self, redis_url: str, db_url: str, tmp: Path) -> None:
        self.redis_url, self.db_url, self.tmp = redis_url, db_url, tmp
        self.queue = f"tiqm-{uuid.uuid4().hex[:8]}"
        self.records = tmp / "records"
        self.records.mkdir()
        self.guard = TaskGuard(db_url, history=True)
        env = dict(os.environ)
        env.update({
            "TIQ_MEET_REDIS": redis_url, "TIQ_MEET_QUEUE": self.queue,
            "TASKGUARD_DATABASE_URL": db_url, "TIQ_RECORDS": str(self.records),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")]),
        })  # fmt: skip
        self.procs = []
        for n in range(2):
            with open(tmp / f"worker{n}.log", "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "taskiq", "worker", "tiq_meet:broker", "--workers", "1",
                     "--shutdown-timeout", "2", "--log-level", "WARNING"],
                    cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                ))  # fmt: skip

    def app(self) -> Any:
        return build(self.redis_url, self.queue, self.db_url, self.records)

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.tmp.glob("worker*.log"))

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.guard.dispose()
        reset_guards()


@pytest.fixture(scope="module")
def meet(pg_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Meet]:
    with (
        pg_database_and_private_redis(pg_template) as (db_url, redis_url),
        contextlib.closing(Meet(redis_url, db_url, tmp_path_factory.mktemp("tiqmeet"))) as env,
    ):
        yield env


def scenario(meet: Meet, steps: Any) -> Any:
    """``steps(app)`` on a sender's broker of its own, started and shut down."""

    async def main() -> Any:
        app = meet.app()
        await app.broker.startup()
        try:
            return await steps(app)
        finally:
            await app.broker.shutdown()

    return asyncio.run(main())


async def nudge_until(app: Any, done: Any, what: str, meet: Meet, timeout: float = 30) -> Any:
    """Poll ``await done()`` while sending nudges (a worker claims a message left unacked
    only after fetching a new one); returns its value."""
    deadline = time.monotonic() + timeout
    while not (found := await done()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{meet.logs()}"
        await app.nudge.kiq()
        await asyncio.sleep(0.3)
    return found


def test_a_finished_message_delivered_again_does_not_run_again(meet: Meet) -> None:
    """The body ran and its result was saved, then its worker died before the ack: the
    broker delivers the message again, and that copy is dropped (the finished record):
    the body ran once; the copy's result is the skipped marker."""

    async def steps(app: Any) -> Any:
        handle = await app.late_ack.kiq(0, 0)
        first = await handle.wait_result(timeout=60, check_interval=0.1)
        os.kill(started(meet.records, 0)["pid"], signal.SIGKILL)  # before its ack

        async def dropped() -> Any:
            result = await app.broker.result_backend.get_result(handle.task_id)
            return result.return_value if is_skipped(result.return_value) else None

        return first.return_value, await nudge_until(app, dropped, "the copy", meet)

    first, again = scenario(meet, steps)
    assert first == {"ran": 0}
    assert again["key"] == "late:0"
    assert "dropped a late copy of finished late_ack" in meet.logs()
    assert [r["i"] for r in read_records(meet.records, "start") if r["task"] == "late_ack"] == [0]


def test_a_killed_runs_message_delivered_again_runs_once_the_key_is_free(meet: Meet) -> None:
    """A worker SIGKILLed mid-run (ttl 2 s), its message unacked: delivered again after
    4 s, it runs (the dead run's lease ran out and is taken over), once."""

    async def steps(app: Any) -> Any:
        handle = await app.long.kiq(1, 1, 2.0)
        victim = await asyncio.to_thread(wait_for, "the run", lambda: started(meet.records, 1))
        os.kill(victim["pid"], signal.SIGKILL)
        await nudge_until(app, lambda: app.broker.result_backend.is_result_ready(handle.task_id),
                          "the copy's result", meet)  # fmt: skip
        return victim["pid"], await app.broker.result_backend.get_result(handle.task_id)

    victim, result = scenario(meet, steps)
    assert not result.is_err and result.return_value == {"ran": 1}, result
    starts = sorted((r for r in read_records(meet.records, "start") if r["task"] == "long"),
                    key=lambda r: r["start"])  # fmt: skip
    ends = [r for r in read_records(meet.records) if r["task"] == "long"]
    assert [r["pid"] == victim for r in starts] == [True, False]
    assert [r["pid"] for r in ends] == [starts[1]["pid"]]
    events = meet.guard.events("long:1")
    owners = [e.owner for e in events if e.event == "acquired"]
    assert len(owners) == 2, events
    assert [e.event for e in events if e.owner == owners[0]][-1] == "taken_over", events
    assert [e.event for e in events if e.owner == owners[1]][-1] == "released", events


def test_a_kiq_cancelled_while_its_acquire_waits(meet: Meet) -> None:
    """``lock="queue"``: a ``kiq`` cancelled while its acquire waits (the lock table
    held by another transaction) ends once the acquire is answered: the lease it got is
    given back and the message is not published."""
    stream = redis.Redis.from_url(meet.redis_url)
    blocker = psycopg.connect(libpq(meet.db_url))

    async def steps(app: Any) -> Any:
        before = stream.xlen(meet.queue)
        blocker.execute("LOCK TABLE task_locks IN SHARE MODE")  # writes wait
        kiq = asyncio.create_task(app.queued.kiq(2, 2))
        await asyncio.sleep(0.5)
        waiting = not kiq.done()
        kiq.cancel()
        await asyncio.sleep(0.3)
        still_waiting = not kiq.done()  # for its acquire, which outlives the cancellation
        blocker.rollback()
        with contextlib.suppress(asyncio.CancelledError):
            await kiq
        await asyncio.sleep(1.0)  # a published message would have been taken meanwhile
        return before, stream.xlen(meet.queue), waiting, still_waiting, kiq.cancelled()

    try:
        before, after, waiting, still_waiting, cancelled = scenario(meet, steps)
    finally:
        blocker.close()
        stream.close()
    assert after == before, "the cancelled send was published"
    assert not any(r.held for r in meet.guard.get_all("qc:2")), "its lease is left held"
    assert not [r for r in read_records(meet.records, "start") if r["task"] == "queued"]
    assert waiting and still_waiting and cancelled
    assert [e.event for e in meet.guard.events("qc:2")] == ["acquired", "released"]
