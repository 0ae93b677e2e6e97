"""taskguard.dramatiq with real ``dramatiq`` workers, brokers and lock databases
(issue 43). The bodies and a middleware of the test's own write independent records
(tg_dramatiq_app.py): what ran when, and how each message ended.

Which scenario runs where (to keep this file near a minute and a half):

* the storm (two ``dramatiq -p 2 -t 4`` workers, 200 sends over 5 keys, 0.2 s
  bodies): RabbitMQ + PostgreSQL, Redis + MariaDB, Redis + SQLite;
* a worker SIGKILLed mid-run: Redis + PostgreSQL (the key freed), RabbitMQ +
  PostgreSQL (the message the broker hands to the other worker runs);
* a PostgreSQL outage during a run and during a send (a TCP proxy the test stops
  and starts): RabbitMQ + PostgreSQL;
* a duplicate send with the queue lock refused before it reaches the broker, and a
  finished message delivered again not run again: Redis + PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from taskguard import AlreadyLocked, DatabaseUnavailable, OutcomeUnknown, TaskGuard
from taskguard.config import reset_guards
from taskguard.demo.record import max_concurrency
from tests.harness.proxy import FaultProxy
from tests.services import AMQP_URL, redis_db

pytest.importorskip("dramatiq")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))
import tg_dramatiq_app as app  # noqa: E402

pytestmark = pytest.mark.timeout(240)

#: The suite's Redis database for this file (tests/services.py).
REDIS_OFFSET = 4
#: Each worker: two processes of four threads.
PROCESSES = ("-p", "2", "-t", "4")
#: How long the workers may take to start on a loaded 2-core machine.
START_TIMEOUT = 90.0


class Workers:
    """``count`` ``dramatiq tg_dramatiq_app -p 2 -t 4`` processes for one broker,
    queue and lock database, each in its own process group."""

    def __init__(self, env: dict[str, str], count: int, logs: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = [logs / f"worker{i}.log" for i in range(count)]
        for log in self.logs:
            with open(log, "wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "dramatiq", "tg_dramatiq_app", *PROCESSES],
                        cwd=HERE,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + START_TIMEOUT
        while self.text().count("ready for action") < 2 * count:
            dead = [p for p in self.procs if p.poll() is not None]
            assert not dead, f"a worker exited at start:\n{self.text()}"
            assert time.monotonic() < deadline, f"workers not ready:\n{self.text()}"
            time.sleep(0.2)

    def text(self) -> str:
        return "".join(log.read_text(errors="replace") for log in self.logs if log.exists())

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


class Env:
    """A broker, a queue of this test's own, a lock database, a records folder, the
    app's actors in this process (the sending side) and its workers."""

    def __init__(self, broker_url: str, db_url: str, tmp: Path) -> None:
        self.queue = f"tgdq-{uuid.uuid4().hex[:10]}"
        self.broker_url, self.db_url = broker_url, db_url
        self.records = tmp / "records"
        self.records.mkdir()
        os.environ["TG_DQ_RECORDS"] = str(self.records)
        self.broker, self.actors = app.make(broker_url, self.queue, db_url)
        self.workers: Workers | None = None
        self.tmp = tmp

    def start(self, count: int = 2) -> Workers:
        env = {**os.environ, "TG_DQ_BROKER": self.broker_url, "TG_DQ_QUEUE": self.queue,
               "TASKGUARD_DATABASE_URL": self.db_url, "TG_DQ_RECORDS": str(self.records),
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        self.workers = Workers(env, count, self.tmp)
        return self.workers

    def lines(self) -> list[list[str]]:
        return [
            line.split()
            for path in self.records.glob("*.log")
            for line in path.read_text().splitlines()
        ]

    def wait_for(self, done: Callable[[list[list[str]]], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.lines()):
            logs = self.workers.text() if self.workers else ""
            assert time.monotonic() < deadline, f"timed out; records {self.lines()}\n{logs}"
            time.sleep(0.2)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.stop()
        if self.broker_url.startswith("amqp"):
            with contextlib.suppress(Exception):
                for name in (self.queue, f"{self.queue}.DQ", f"{self.queue}.XQ"):
                    self.broker.channel.queue_delete(name)
        self.broker.close()
        reset_guards()


@pytest.fixture
def env_for(tmp_path: Path) -> Iterator[Callable[[str, str], Env]]:
    made: list[Env] = []

    def make(broker: str, db_url: str) -> Env:
        # pika reads kombu's default vhost "//" as an empty name: "/" is %2F there
        amqp = AMQP_URL[:-2] + "/%2F" if AMQP_URL.endswith("//") else AMQP_URL
        url = amqp if broker == "rabbitmq" else redis_db(REDIS_OFFSET)
        made.append(Env(url, db_url, tmp_path))
        return made[-1]

    yield make
    for env in made:
        env.close()


def _runs(lines: list[list[str]]) -> dict[int, list[tuple[str, float]]]:
    """Per send number, its body's start and end events."""
    out: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for event, n, _key, at, *_ in lines:
        if event in ("start", "end"):
            out[int(n)].append((event, float(at)))
    return out


def _most_at_once(lines: list[list[str]]) -> dict[str, int]:
    """Per key, the most bodies running at once (from the bodies' own times)."""
    spans: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for event, n, key, at, *_ in lines:
        if event in ("start", "end"):
            spans[key, n][event] = float(at)
    by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (key, _n), times in spans.items():
        by_key[key].append((times["start"], times.get("end", float("inf"))))
    return {key: max_concurrency(intervals) for key, intervals in by_key.items()}


@pytest.mark.parametrize(
    ("broker", "store"),
    [("rabbitmq", "pg_url"), ("redis", "maria_url"), ("redis", "sqlite_url")],
)
def test_storm_runs_each_key_once_at_a_time(
    env_for: Callable[[str, str], Env], request: pytest.FixtureRequest, broker: str, store: str
) -> None:
    env = env_for(broker, request.getfixturevalue(store))
    env.start(2)
    fetch = env.actors["fetch"]
    for n in range(200):
        fetch.send(f"k{n % 5}", n)

    def ended(lines: list[list[str]]) -> bool:
        return len({int(n) for event, n, *_ in lines if event in ("done", "skip", "fail")}) >= 200

    env.wait_for(ended, timeout=120)
    time.sleep(0.5)  # nothing more comes
    lines = env.lines()
    outcomes = Counter(int(n) for event, n, *_ in lines if event in ("done", "skip", "fail"))
    kinds = {int(n): event for event, n, *_ in lines if event in ("done", "skip", "fail")}
    runs = _runs(lines)
    assert set(outcomes) == set(range(200)), "every send ended"
    assert max(outcomes.values()) == 1, "no message ended twice"
    assert "fail" not in kinds.values(), [line for line in lines if line[0] == "fail"]
    for n, events in runs.items():  # a run started, ended, once, and reported done
        assert [e for e, _ in events] == ["start", "end"], (n, events)
        assert kinds[n] == "done"
    assert all(kinds[n] == "skip" for n in set(range(200)) - set(runs)), "the rest skipped"
    assert set(_most_at_once(lines).values()) == {1}, _most_at_once(lines)
    assert len(runs) >= 5  # each key ran at least once


def test_a_killed_worker_frees_its_key_within_the_ttl(
    env_for: Callable[[str, str], Env], pg_url: str
) -> None:
    env = env_for("redis", pg_url)
    env.start(1)
    message = env.actors["slow"].send("kill", 1)
    env.wait_for(lambda lines: any(line[0] == "start" for line in lines))
    pid = int(next(line for line in env.lines() if line[0] == "start")[4])
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    guard = TaskGuard(pg_url, history=True)
    try:
        lease = None
        while lease is None:
            assert time.monotonic() - killed < 3 + 10, "the key was not freed within the ttl"
            lease = guard.try_acquire("slow:kill", 5, task_name="test").lease
            time.sleep(0.2)
        story = guard.explain("slow:kill")
        guard.release(lease)
    finally:
        guard.dispose()
    assert "taken over" in story and message.message_id in story, story
    assert not any(line[0] == "end" for line in env.lines())


def test_a_killed_workers_message_runs_once_the_key_frees(
    env_for: Callable[[str, str], Env], pg_url: str
) -> None:
    # RabbitMQ hands the dead worker's unacked message to the other worker at once:
    # that copy finds the key held by its own message (the dead run's lease), which
    # is not a duplicate: it runs once the lease ends, never skipped (a lost job).
    env = env_for("rabbitmq", pg_url)
    env.start(2)
    env.actors["slow"].send("again", 1, 1.0)
    env.wait_for(lambda lines: any(line[0] == "start" for line in lines))
    pid = int(next(line for line in env.lines() if line[0] == "start")[4])
    os.kill(pid, signal.SIGKILL)
    env.wait_for(lambda lines: any(line[0] in ("done", "skip", "fail") for line in lines), 60)
    ended = [line for line in env.lines() if line[0] in ("done", "skip", "fail")]
    starts = sorted((line for line in env.lines() if line[0] == "start"), key=lambda s: float(s[3]))
    assert [line[0] for line in ended] == ["done"], env.lines()
    assert len(starts) == 2 and int(starts[1][4]) != pid, env.lines()
    # It started once the dead run's lease (ttl 3 s) had run out, not before.
    assert float(starts[1][3]) - float(starts[0][3]) >= 2.5, env.lines()


@pytest.fixture
def proxied(pg_url: str) -> Iterator[tuple[FaultProxy, str]]:
    with FaultProxy(make_url(pg_url).port or 5432) as proxy:
        yield proxy, make_url(pg_url).set(port=proxy.port).render_as_string(hide_password=False)


def test_an_outage_during_a_run_and_a_send(
    env_for: Callable[[str, str], Env], proxied: tuple[FaultProxy, str]
) -> None:
    proxy, url = proxied
    env = env_for("rabbitmq", url)
    env.start(1)
    fetch, queued = env.actors["fetch"], env.actors["queued"]
    fetch.send("out", 1, 5.0)
    env.wait_for(lambda lines: any(line[:2] == ["start", "1"] for line in lines))
    proxy.refuse = True
    proxy.cut_all()
    # A run delivered during the outage cannot take its key: it fails, visibly.
    fetch.send("out", 2)
    # A send during the outage cannot take its queue lock: it raises, nothing is queued.
    with pytest.raises((DatabaseUnavailable, OutcomeUnknown)):
        queued.send("qout", 3)
    env.wait_for(lambda lines: any(line[:2] == ["fail", "2"] for line in lines), timeout=30)
    proxy.refuse = False
    queued.send("qout", 4)
    env.wait_for(lambda lines: {"1", "4"} <= {line[1] for line in lines if line[0] == "done"})
    lines = env.lines()
    assert next(line for line in lines if line[:2] == ["fail", "2"])[5] in (
        "DatabaseUnavailable", "OutcomeUnknown",
    )  # fmt: skip
    assert not any(line[1] in ("2", "3") and line[0] == "start" for line in lines)
    assert set(_most_at_once(lines).values()) == {1}
    assert "DatabaseUnavailable" in env.workers.text() or "OutcomeUnknown" in env.workers.text()


def test_a_duplicate_send_is_refused_before_the_broker(
    env_for: Callable[[str, str], Env], pg_url: str
) -> None:
    env = env_for("redis", pg_url)
    queued = env.actors["queued"]
    first = queued.send("dup", 1)
    with pytest.raises(AlreadyLocked) as refused:
        queued.send("dup", 2)
    assert "queued:dup" in str(refused.value)
    assert env.broker.client.llen(f"dramatiq:{env.queue}") == 1
    guard = TaskGuard(pg_url)
    try:
        (row,) = [r for r in guard.get_all("queued:dup") if r.held]
    finally:
        guard.dispose()
    assert row.holder.task_id == first.message_id
    env.start(1)  # the queued message runs, adopting the lease its send took
    env.wait_for(lambda lines: any(line[:2] == ["done", "1"] for line in lines))
    # Another delivery of the finished message (as after a lost ack) does not run again.
    env.broker.enqueue(first)
    env.wait_for(lambda lines: any(line[:2] == ["skip", "1"] for line in lines))
    assert [line[0] for line in env.lines() if line[1] == "1"].count("start") == 1
    assert queued.send("dup", 3).message_id  # free again
