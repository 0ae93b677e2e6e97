"""The example's taskiq application: a Redis broker with taskguard's middleware and
one guarded task. Workers: ``taskiq worker feeds:broker``."""

from __future__ import annotations

import asyncio
import json
import os
import time

from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend

from taskguard.taskiq import TaskguardMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
#: Each run appends one line here: which feed, which process, when it started and ended.
RUNS_FILE = os.environ.get("RUNS_FILE", "runs.jsonl")

broker = (
    ListQueueBroker(REDIS_URL, queue_name="taskiqfeeds", socket_timeout=None)
    .with_result_backend(RedisAsyncResultBackend(REDIS_URL, result_ex_time=600))
    # The locks database: $TASKGUARD_DATABASE_URL (taskguard db upgrade creates its tables).
    .with_middlewares(TaskguardMiddleware(history=True))
)


@broker.task(taskguard={"key": "feed:{url}", "ttl": 30})
async def import_feed(url: str) -> object:
    """At most one import of a feed at a time; a duplicate is skipped."""
    start = time.time()
    await asyncio.sleep(0.3)  # fetching and storing the feed
    with open(RUNS_FILE, "a") as runs:
        runs.write(
            json.dumps({"url": url, "pid": os.getpid(), "start": start, "end": time.time()}) + "\n"
        )
    return f"imported {url}"
