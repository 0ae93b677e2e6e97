"""The taskiq application of tests/integration/taskiq: a Redis list broker and result
backend, taskguard's middleware, and the guarded tasks the scenarios kick.

``build(redis_url, queue, database_url, records)`` declares them; a worker process
loads ``tiq_app:broker``, built from the environment (``TIQ_REDIS_URL``,
``TIQ_QUEUE``, ``TASKGUARD_DATABASE_URL``, ``TIQ_RECORDS``). Every body that runs
appends one JSON line (task, i, key number, pid, start, end) to a file of its own
process under ``records``: the record the assertions count.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend

from taskguard.taskiq import TaskguardMiddleware, guarded


def _record(records: Path, **fields: Any) -> None:
    line = json.dumps({**fields, "pid": os.getpid()}) + "\n"
    with open(records / f"{os.getpid()}.jsonl", "a") as f:  # one write, appended whole
        f.write(line)


def build(redis_url: str, queue: str, database_url: str, records: Path) -> SimpleNamespace:
    broker = (
        # socket_timeout=None: BRPOP waits as long as the queue is empty (with redis-py 8's
        # default of 5 s an idle worker's listener fails with a TimeoutError); connecting
        # may take longer than 5 s on a loaded machine.
        ListQueueBroker(redis_url, queue_name=queue, socket_timeout=None, socket_connect_timeout=30)
        .with_result_backend(
            RedisAsyncResultBackend(
                redis_url, result_ex_time=600, socket_timeout=30, socket_connect_timeout=30
            )
        )
        .with_middlewares(TaskguardMiddleware(database_url, history=True))
    )

    async def body(task: str, i: int, n: int, seconds: float) -> dict[str, Any]:
        start = time.time()
        _record(records, task=task, i=i, n=n, phase="start", start=start)
        await asyncio.sleep(seconds)
        _record(records, task=task, i=i, n=n, phase="end", start=start, end=time.time())
        return {"ran": i}

    # The storm: the run lock, a duplicate run skipped (returns the marker).
    @broker.task(task_name="storm_run", taskguard={"key": "storm:{n}", "ttl": 10})
    async def storm_run(i: int, n: int, seconds: float = 0.2) -> dict[str, Any]:
        return await body("storm_run", i, n, seconds)

    # ... and the queue lock: a duplicate send skipped before it reaches the broker.
    @guarded(key="storm:{n}", ttl=10, lock="queue_and_run")
    @broker.task(task_name="storm_queue")
    async def storm_queue(i: int, n: int, seconds: float = 0.2) -> dict[str, Any]:
        return await body("storm_queue", i, n, seconds)

    # A sync body: taskiq runs it on its thread pool, the guard's sync run around it.
    @broker.task(task_name="sync_run", taskguard={"key": "sync:{n}", "ttl": 10})
    def sync_run(i: int, n: int, seconds: float = 0.2) -> dict[str, Any]:
        start = time.time()
        _record(records, task="sync_run", i=i, n=n, phase="start", start=start)
        time.sleep(seconds)
        _record(records, task="sync_run", i=i, n=n, phase="end", start=start, end=time.time())
        return {"ran": i}

    # A long run with a short ttl (renewed while it runs), stopped if its lease is lost:
    # the SIGKILL, outage and lag scenarios.
    @broker.task(
        task_name="hold",
        taskguard={"key": "hold:{n}", "ttl": 3, "stop_on_lease_loss": True},
    )
    async def hold(i: int, n: int, seconds: float) -> dict[str, Any]:
        return await body("hold", i, n, seconds)

    # A duplicate send refused: the sender gets AlreadyLocked.
    @broker.task(
        task_name="queue_raise",
        taskguard={"key": "qr:{n}", "lock": "queue", "on_conflict": "raise", "ttl": 10},
    )
    async def queue_raise(i: int, n: int, seconds: float = 0.2) -> dict[str, Any]:
        return await body("queue_raise", i, n, seconds)

    @broker.task(
        task_name="queue_existing",
        taskguard={"key": "qe:{n}", "lock": "queue", "on_conflict": "existing", "ttl": 10},
    )
    async def queue_existing(i: int, n: int, seconds: float = 0.2) -> dict[str, Any]:
        return await body("queue_existing", i, n, seconds)

    # Unguarded: samples this worker's event-loop lag (sleeps of 1 ms, overshoot in ms).
    @broker.task(task_name="lag_probe")
    async def lag_probe(seconds: float) -> dict[str, float]:
        lags = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((time.perf_counter() - before - 0.001) * 1000)
        lags.sort()
        return {
            "samples": len(lags),
            "p50": statistics.median(lags),
            "p99": lags[int(len(lags) * 0.99) - 1],
            "max": lags[-1],
        }

    return SimpleNamespace(
        broker=broker, **{t.task_name: t for t in broker.get_all_tasks().values()}
    )


if "TIQ_QUEUE" in os.environ:  # a worker process
    app = build(
        os.environ["TIQ_REDIS_URL"],
        os.environ["TIQ_QUEUE"],
        os.environ["TASKGUARD_DATABASE_URL"],
        Path(os.environ["TIQ_RECORDS"]),
    )
    broker = app.broker
