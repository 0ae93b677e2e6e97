"""taskguard.dramatiq in one process: Dramatiq's stub broker and an in-process worker
(its real middleware: Retries, TimeLimit, ...), locks on SQLite. What each conflict
mode does at a send and at the start of a run, and what the body sees. The worker
processes, brokers and faults: test_dramatiq_workers.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from taskguard import AlreadyLocked, ConfigurationError, TaskGuard, current_lease, is_skipped

dramatiq = pytest.importorskip("dramatiq")
from dramatiq.brokers.stub import StubBroker  # noqa: E402
from dramatiq.common import dq_name  # noqa: E402

from taskguard.dramatiq import TaskGuardMiddleware  # noqa: E402


@pytest.fixture
def broker(sqlite_url: str) -> Iterator[Any]:
    stub = StubBroker()
    stub.add_middleware(TaskGuardMiddleware(sqlite_url))
    yield stub
    stub.close()


@pytest.fixture
def guard(sqlite_url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(sqlite_url)
    yield g
    g.dispose()


def _work(broker: Any, queue: str = "default") -> None:
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        broker.join(queue, fail_fast=False)
        worker.join()
    finally:
        worker.stop()


def test_a_duplicate_send_is_skipped_answered_or_put_off(broker: Any) -> None:
    def declare(name: str, conflict: str) -> Any:
        return dramatiq.actor(lambda feed: None, broker=broker, actor_name=name,
                              key="feed:{feed}", lock="queue_and_run", on_conflict=conflict)  # fmt: skip

    skip, existing, retry = declare("s", "skip"), declare("e", "existing"), declare("r", "retry")
    first = skip.send("a")
    assert is_skipped(skip.send("a"))
    assert broker.queues["default"].qsize() == 1
    queued = existing.send("b")
    assert existing.send("b").message_id == queued.message_id
    retry.send("c")
    later = retry.send("c")  # published with a delay; its key is taken when it comes due
    assert later.options["eta"] > 0
    assert broker.queues[dq_name("default")].qsize() == 1
    assert first.message_id != queued.message_id
    assert broker.queues["default"].qsize() == 3


def test_a_busy_key_at_the_start_of_a_run(broker: Any, guard: TaskGuard) -> None:
    ran: list[str] = []

    @dramatiq.actor(broker=broker, key="k:{n}", on_conflict="retry", retry_countdown=0.2)
    def later(n: int) -> None:
        ran.append(f"later {n}")

    @dramatiq.actor(broker=broker, key="k:{n}", on_conflict="raise", throws=(AlreadyLocked,))
    def refused(n: int) -> None:
        ran.append(f"refused {n}")

    @dramatiq.actor(broker=broker, key="k:{n}")
    def skipped(n: int) -> None:
        ran.append(f"skipped {n}")

    assert guard.acquire("k:1", 1.5, task_name="test") is not None  # left to expire
    for actor in (later, refused, skipped):
        actor.send(1)
    _work(broker)  # Retries brings `later` back until the key is free
    assert ran == ["later 1"]
    assert [m.actor_name for m in broker.dead_letters] == ["refused"]


def test_the_body_holds_its_lease_and_frees_the_key(broker: Any, guard: TaskGuard) -> None:
    seen: list[Any] = []

    @dramatiq.actor(broker=broker, key="lease:{n}", ttl=30)
    def body(n: int) -> None:
        lease = current_lease()
        seen.append((lease.key, lease.ttl) if lease else None)

    body.send(7)
    _work(broker)
    assert seen == [("lease:7", 30)]
    assert not any(r.held for r in guard.get_all("lease:7"))


def test_misspelled_settings_and_options_are_refused(broker: Any) -> None:
    with pytest.raises(ConfigurationError, match="did you mean taskguard_history"):
        TaskGuardMiddleware(histroy=True)
    with pytest.raises(ValueError, match="on_conflit"):  # Dramatiq's own check
        dramatiq.actor(lambda: None, broker=broker, actor_name="typo", on_conflit="skip")
    with pytest.raises(ConfigurationError, match="task bad: on_conflict='coalesce' is not"):
        dramatiq.actor(lambda: None, broker=broker, actor_name="bad", on_conflict="coalesce")
