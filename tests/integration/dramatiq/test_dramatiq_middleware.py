"""taskguard.dramatiq beside Dramatiq's own middleware (issue 43): TimeLimit, AgeLimit,
Retries, Callbacks, Pipelines and groups, with one real ``dramatiq`` worker for the
module (one process, four threads), a private Redis server as the broker and
PostgreSQL for the locks. The app: tg_dramatiq_meet.py; its records say what ran,
when, and how each delivery ended once every middleware acted (docs/dramatiq.md,
"With Dramatiq's other middleware")."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dramatiq import group, pipeline

from taskguard import TaskGuard
from taskguard.config import reset_guards
from taskguard.demo.record import max_concurrency
from tests.services import pg_database_and_private_redis

pytest.importorskip("dramatiq")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))
import tg_dramatiq_meet as app  # noqa: E402

pytestmark = pytest.mark.timeout(120)

#: How long the worker may take to start on a loaded 2-core machine.
START_TIMEOUT = 90.0

Lines = list[list[str]]


class Meet:
    """The module's worker, broker (the sending side), lock database and records."""

    def __init__(self, redis_url: str, db_url: str, tmp: Path) -> None:
        self.records, self.db_url = tmp / "records", db_url
        self.records.mkdir()
        queue = f"meet-{uuid.uuid4().hex[:8]}"
        self.broker, self.actors = app.make(redis_url, queue, db_url)
        self.guard = TaskGuard(db_url, history=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TG_DQ_BROKER")}
        env.update({"TG_MEET_BROKER": redis_url, "TG_MEET_QUEUE": queue,
                    "TASKGUARD_DATABASE_URL": db_url, "TG_DQ_RECORDS": str(self.records),
                    "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])})  # fmt: skip
        self.log = tmp / "worker.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dramatiq", "tg_dramatiq_meet", "-p", "1", "-t", "4"],
                cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while "ready for action" not in self.log.read_text(errors="replace"):
            assert self.proc.poll() is None, f"the worker exited:\n{self.text()}"
            assert time.monotonic() < deadline, f"the worker is not ready:\n{self.text()}"
            time.sleep(0.2)
        # The worker's first guarded run makes its guard (an engine, a connection): done
        # here, not within a test's time limit.
        self.actors["step"].send("warm", 0)
        self.wait_for(lambda: "done" in events(self.lines(0)), timeout=START_TIMEOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def lines(self, *numbers: int) -> Lines:
        """The records of these send numbers, in time order."""
        wanted = {str(n) for n in numbers}
        found = [
            line.split()
            for path in self.records.glob("*.log")
            for line in path.read_text().splitlines()
        ]
        return sorted((r for r in found if r[1] in wanted), key=lambda r: float(r[3]))

    def wait_for(self, done: Callable[[], Any], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"timed out; worker log:\n{self.text()[-3000:]}"
            time.sleep(0.1)

    def held(self, key: str) -> bool:
        return any(r.held for r in self.guard.get_all(key))

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.broker.close()
        self.guard.dispose()
        reset_guards()


@pytest.fixture(scope="module")
def meet(pg_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Meet]:
    with (
        pg_database_and_private_redis(pg_template) as (db_url, redis_url),
        contextlib.closing(Meet(redis_url, db_url, tmp_path_factory.mktemp("meet"))) as env,
    ):
        yield env


def events(lines: Lines, *kinds: str) -> list[str]:
    """The events of these records (of these kinds only, if given)."""
    return [r[0] for r in lines if not kinds or r[0] in kinds]


def lease_story(guard: TaskGuard, key: str) -> list[str]:
    """The key's acquisitions and how each ended, oldest first."""
    return [e.event for e in guard.events(key) if e.event in ("acquired", "released", "taken_over")]


def test_time_limit_frees_the_key_at_once_and_retries_run(meet: Meet) -> None:
    """A body past its time_limit (400 ms, the first attempt would run 3 s): the
    interrupt gives the lease back at once (ttl 30 s): Retries' retry (max_retries=1)
    runs within a second and finishes; with max_retries=0 the message fails for good
    and the key is free when it does."""
    limited = meet.actors["limited"]
    limited.send("a", 10)
    limited.send_with_options(args=("b", 11), max_retries=0)
    meet.wait_for(lambda: "done" in events(meet.lines(10)) and "dead" in events(meet.lines(11)))
    assert not meet.held("tl:b")  # free as it failed, not after 30 s
    first, second = meet.lines(10), meet.lines(11)
    ran = ["start", "again", "start", "end", "done"]  # interrupted, then retried
    assert events(first, "start", "end", "again", "done") == ran
    assert [r[5] for r in first if r[0] in ("start", "end")] == ["0", "1", "1"]  # the attempts
    assert next(r for r in first if r[0] == "again")[5] == "TimeLimitExceeded"
    starts = [float(r[3]) for r in first if r[0] == "start"]
    assert starts[1] - starts[0] < 5, "the retry waited for the ttl"
    assert events(second, "start", "end", "dead") == ["start", "dead"]
    assert next(r for r in second if r[0] == "dead")[5] == "TimeLimitExceeded"
    assert lease_story(meet.guard, "tl:a") == ["acquired", "released"] * 2
    assert lease_story(meet.guard, "tl:b") == ["acquired", "released"]


@pytest.mark.parametrize("actor", ["aged_queue", "aged_both"])
def test_a_message_dropped_by_age_limit_gives_its_queue_lease_back(meet: Meet, actor: str) -> None:
    """``lock="queue"`` and ``"queue_and_run"``: a message AgeLimit drops before it runs
    (``max_age=1`` ms) gives back the lease its send took (queue_ttl 30 s)."""
    n = 20 if actor == "aged_queue" else 21
    sent = meet.actors[actor].send_with_options(args=("x", n), max_age=1)
    key = ("ageq:x", "ageb:x")[n - 20]
    meet.wait_for(lambda: "skip" in events(meet.lines(n)))
    meet.wait_for(lambda: not meet.held(key), timeout=5)
    assert [r[0] for r in meet.lines(n)] == ["skip"]  # dropped: never started
    assert meet.lines(n)[0][5] == "failed"  # AgeLimit's own verdict
    story = meet.guard.events(key)  # the send's lease (handed to the drop), released
    assert {e.holder.task_id for e in story if e.event == "acquired"} == {sent.message_id}
    assert lease_story(meet.guard, key)[-1] == "released", story


def test_retries_on_a_busy_key_and_a_failing_body(meet: Meet) -> None:
    """``on_conflict="retry"`` (every 0.3 s, max_retries=2): a key held throughout is
    tried three times, then the message fails for good (never run, never lost); one
    whose key frees after its first try runs then. A body that raises twice is retried
    by Retries (each attempt takes and gives back the lease) and finishes on the third;
    delivered again afterwards it does not run again (the finished record)."""
    busy, flaky = meet.actors["busy"], meet.actors["flaky"]
    held = meet.guard.acquire("busy:held", 30, task_name="test")
    soon = meet.guard.acquire("busy:soon", 30, task_name="test")
    assert held is not None and soon is not None
    busy.send("held", 30)
    busy.send("soon", 31)
    message = flaky.send("f", 32)
    meet.wait_for(lambda: "again" in events(meet.lines(31)))
    meet.guard.release(soon)
    meet.wait_for(lambda: "dead" in events(meet.lines(30)) and "done" in events(meet.lines(31)))
    meet.guard.release(held)
    tries = meet.lines(30)
    assert events(tries, "start", "again", "dead") == ["again", "again", "dead"]
    assert {r[5] for r in tries} == {"Retry"}
    at = [float(r[3]) for r in tries]
    assert min(b - a for a, b in itertools.pairwise(at)) >= 0.25, at  # retry_countdown=0.3
    assert events(meet.lines(31), "start", "end", "done")[-3:] == ["start", "end", "done"]
    # The failing body: three attempts, the lease given back after each.
    meet.wait_for(lambda: "done" in events(meet.lines(32)))
    attempts = events(meet.lines(32), "start", "again", "done")
    assert attempts == ["start", "again", "start", "again", "start", "done"]
    assert lease_story(meet.guard, "flaky:f") == ["acquired", "released"] * 3
    meet.broker.enqueue(message)  # delivered again after it finished
    meet.wait_for(lambda: "skip" in events(meet.lines(32)))
    assert events(meet.lines(32), "start").count("start") == 3


def test_pipelines_and_callbacks_on_a_busy_key(meet: Meet) -> None:
    """A pipeline whose step is skipped on a busy key ends there (its successor never
    sent, its on_success not called), as AgeLimit's skip ends one; with
    ``on_conflict="retry"`` the step runs once the key frees and the pipeline goes on."""
    step, step_retry = meet.actors["step"], meet.actors["step_retry"]
    lease = meet.guard.acquire("pipe:p", 30, task_name="test")
    assert lease is not None
    pipeline([
        step.message_with_options(args=("p", 40), on_success="noted"),
        step.message_with_options(args=("q", 41), pipe_ignore=True),
    ], broker=meet.broker).run()  # fmt: skip
    pipeline([
        step_retry.message_with_options(args=("p", 42), on_success="noted"),
        step.message_with_options(args=("r", 43), pipe_ignore=True),
    ], broker=meet.broker).run()  # fmt: skip
    meet.wait_for(lambda: "skip" in events(meet.lines(40)) and "again" in events(meet.lines(42)))
    meet.guard.release(lease)
    meet.wait_for(lambda: "done" in events(meet.lines(43)) and "callback" in events(meet.lines(42)))
    time.sleep(0.5)  # nothing more comes for the skipped pipeline
    assert [r[0] for r in meet.lines(40, 41)] == ["skip"]
    assert events(meet.lines(42), "start", "end", "done")[-3:] == ["start", "end", "done"]
    assert events(meet.lines(42), "callback") == ["callback"]  # on_success, once


def test_a_group_of_one_key_runs_one_at_a_time(meet: Meet) -> None:
    """A group of three messages of one key (``on_conflict="wait"``, body 0.3 s): they
    run one after another, each once, and the group's completion callback fires after
    the last."""
    waiter, noted = meet.actors["waiter"], meet.actors["noted"]
    done = noted.message({"args": ["g", 59]}, None)
    members = group([waiter.message("g", n) for n in (50, 51, 52)], broker=meet.broker)
    members.add_completion_callback(done)
    members.run()
    meet.wait_for(lambda: "callback" in events(meet.lines(59)))
    lines = meet.lines(50, 51, 52)
    spans = {r[1]: [float(x[3]) for x in lines if x[1] == r[1] and x[0] in ("start", "end")]
             for r in lines}  # fmt: skip
    assert sorted(spans) == ["50", "51", "52"] and all(len(s) == 2 for s in spans.values()), lines
    assert max_concurrency([(s[0], s[1]) for s in spans.values()]) == 1
    assert float(meet.lines(59)[0][3]) >= max(s[1] for s in spans.values())
