"""The taskiq app of test_taskiq_brokers.py: a broker that redelivers, taskiq-redis's
``RedisStreamBroker`` (a consumer group; a message is acked once its result is saved;
one left unacked for ``IDLE_MS`` is claimed and delivered again by the next worker that
fetches a message), its result backend and taskguard's middleware.

``build(redis_url, queue, database_url, records)`` declares the tasks; a worker
process loads ``tiq_meet:broker``, built from its environment (``TIQ_MEET_REDIS``,
``TIQ_MEET_QUEUE``, ``TASKGUARD_DATABASE_URL``, ``TIQ_RECORDS``). Every body writes
its start and end to ``records`` (tiq_app's record).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from taskiq import TaskiqMessage, TaskiqMiddleware, TaskiqResult
from taskiq_redis import RedisAsyncResultBackend, RedisStreamBroker
from tiq_app import _record

from taskguard.results import is_skipped
from taskguard.taskiq import TaskguardMiddleware

#: How long a message stays unacked before another delivery of it (ms): above the
#: ``ttl`` of the killed run's task, so that its copy comes once the key is free.
IDLE_MS = 4000


class LateAck(TaskiqMiddleware):
    """Holds back the ack of ``late_ack`` after its body ran and its result was saved
    (the worker is killed meanwhile: an ack lost after the run finished)."""

    async def post_save(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        if message.task_name == "late_ack" and not is_skipped(result.return_value):
            await asyncio.sleep(60)


def build(redis_url: str, queue: str, database_url: str, records: Path) -> SimpleNamespace:
    broker = (
        RedisStreamBroker(
            redis_url,
            queue_name=queue,
            idle_timeout=IDLE_MS,
            xread_block=300,
            unacknowledged_lock_timeout=2,
            socket_connect_timeout=30,
        )
        .with_result_backend(RedisAsyncResultBackend(redis_url, result_ex_time=600))
        .with_middlewares(LateAck(), TaskguardMiddleware(database_url, history=True))
    )

    async def body(task: str, i: int, n: int, seconds: float) -> dict[str, Any]:
        start = time.time()
        _record(records, task=task, i=i, n=n, phase="start", start=start)
        await asyncio.sleep(seconds)
        _record(records, task=task, i=i, n=n, phase="end", start=start, end=time.time())
        return {"ran": i}

    @broker.task(task_name="late_ack", taskguard={"key": "late:{n}", "ttl": 10})
    async def late_ack(i: int, n: int) -> object:
        return await body("late_ack", i, n, 0.2)

    # ttl 2 s (< IDLE_MS): a killed run's key is free when its message comes again.
    @broker.task(task_name="long", taskguard={"key": "long:{n}", "ttl": 2})
    async def long(i: int, n: int, seconds: float) -> object:
        return await body("long", i, n, seconds)

    @broker.task(task_name="queued", taskguard={"key": "qc:{n}", "lock": "queue", "ttl": 10})
    async def queued(i: int, n: int) -> object:
        return await body("queued", i, n, 0.1)

    # A worker claims messages left unacked only after it fetched a new one: the tests
    # send these meanwhile.
    @broker.task(task_name="nudge")
    async def nudge() -> None:
        return None

    return SimpleNamespace(broker=broker, late_ack=late_ack, long=long, queued=queued, nudge=nudge)


if "TIQ_MEET_QUEUE" in os.environ:  # a worker process
    broker = build(
        os.environ["TIQ_MEET_REDIS"],
        os.environ["TIQ_MEET_QUEUE"],
        os.environ["TASKGUARD_DATABASE_URL"],
        Path(os.environ["TIQ_RECORDS"]),
    ).broker
