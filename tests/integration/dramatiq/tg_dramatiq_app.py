"""The Dramatiq app of tests/integration/dramatiq: ``make(broker_url, queue)``
declares its actors on a new broker with taskguard's middleware; imported by a
``dramatiq`` worker, the module does that from its environment (``TG_DQ_BROKER``,
``TG_DQ_QUEUE``, ``TASKGUARD_DATABASE_URL``, ``TG_DQ_RECORDS``).

Every body and every outcome leaves an independent record, not taskguard's: one
line per event in ``$TG_DQ_RECORDS/<pid>.log`` (``start``/``end`` with the time,
written by the body; ``done``/``fail``/``skip`` written by a middleware of the
test's own), so the tests can tell what ran, when, and how each message ended.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware

from taskguard.dramatiq import TaskGuardMiddleware

_write = threading.Lock()


def record(event: str, n: int, key: str = "-", detail: str = "-") -> None:
    folder = os.environ.get("TG_DQ_RECORDS")
    if not folder:
        return
    line = f"{event} {n} {key} {time.time():.6f} {os.getpid()} {detail}\n"
    with _write, open(Path(folder) / f"{os.getpid()}.log", "a") as out:
        out.write(line)
        out.flush()


class Recorder(Middleware):
    """How each message ended, as the broker's own hooks tell it."""

    def after_process_message(
        self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        n = message.args[1] if len(message.args) > 1 else -1
        if exception is None:
            record("done", n)
        else:
            record("fail", n, detail=type(exception).__name__)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        record("skip", message.args[1] if len(message.args) > 1 else -1)


def make(
    broker_url: str, queue: str, database_url: str | None = None
) -> tuple[Any, dict[str, Any]]:
    if broker_url.startswith("amqp"):
        broker: Any = RabbitmqBroker(url=broker_url)
    else:
        broker = RedisBroker(url=broker_url)
    broker.add_middleware(TaskGuardMiddleware(database_url, history=True, call_timeout=3))
    broker.add_middleware(Recorder())

    def body(feed: str, n: int, seconds: float) -> None:
        record("start", n, feed)
        time.sleep(seconds)
        record("end", n, feed)

    @dramatiq.actor(broker=broker, actor_name="fetch", queue_name=queue, max_retries=0,
                    key="feed:{feed}", ttl=10)  # fmt: skip
    def fetch(feed: str, n: int, seconds: float = 0.2) -> None:
        body(feed, n, seconds)

    @dramatiq.actor(broker=broker, actor_name="slow", queue_name=queue, max_retries=0,
                    key="slow:{feed}", ttl=3)  # fmt: skip
    def slow(feed: str, n: int, seconds: float = 30) -> None:
        body(feed, n, seconds)

    @dramatiq.actor(broker=broker, actor_name="queued", queue_name=queue, max_retries=0,
                    key="queued:{feed}", lock="queue_and_run", on_conflict="raise", ttl=10)  # fmt: skip
    def queued(feed: str, n: int, seconds: float = 0.2) -> None:
        body(feed, n, seconds)

    return broker, {"fetch": fetch, "slow": slow, "queued": queued}


if "TG_DQ_BROKER" in os.environ:
    broker, actors = make(os.environ["TG_DQ_BROKER"], os.environ["TG_DQ_QUEUE"])
    dramatiq.set_broker(broker)
