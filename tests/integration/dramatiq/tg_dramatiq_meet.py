"""The Dramatiq app of test_dramatiq_middleware.py: guarded actors beside Dramatiq's
own middleware (AgeLimit, TimeLimit, Callbacks, Pipelines, GroupCallbacks, Retries,
CurrentMessage) on a Redis broker. ``make(redis_url, queue, database_url)`` declares
them on a new broker; imported by a ``dramatiq`` worker, the module does that from
its environment (``TG_MEET_BROKER``, ``TG_MEET_QUEUE``, ``TASKGUARD_DATABASE_URL``).

Records (tg_dramatiq_app.record, in ``$TG_DQ_RECORDS``): ``start``/``end`` written by
the bodies (detail: the attempt, Dramatiq's ``retries``); how each delivery ended,
written by :class:`Outcomes` after every other middleware (Retries included) acted:
``done``, ``again`` (to be retried), ``dead`` (failed for good), ``skip``;
``callback`` by the completion and success callbacks.
"""

from __future__ import annotations

import os
import time
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    CurrentMessage,
    GroupCallbacks,
    Middleware,
    Pipelines,
    Retries,
    ShutdownNotifications,
    TimeLimit,
)
from dramatiq.rate_limits.backends import RedisBackend
from tg_dramatiq_app import record

from taskguard.dramatiq import TaskGuardMiddleware


class Outcomes(Middleware):
    """How each delivery ended; first in the list, so its after-hooks run last."""

    def after_process_message(
        self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        if exception is None:
            record("done", message.args[1])
        else:
            event = "dead" if message.failed else "again"
            record(event, message.args[1], detail=type(exception).__name__)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        record("skip", message.args[1], detail="failed" if message.failed else "-")


def make(redis_url: str, queue: str, database_url: str | None = None) -> tuple[Any, dict[str, Any]]:
    middleware = [
        Outcomes(), AgeLimit(), TimeLimit(interval=100), ShutdownNotifications(), Callbacks(),
        Pipelines(), GroupCallbacks(RedisBackend(url=redis_url)), Retries(), CurrentMessage(),
    ]  # fmt: skip
    broker = RedisBroker(url=redis_url, middleware=middleware)
    broker.add_middleware(TaskGuardMiddleware(database_url, history=True, call_timeout=3))

    def actor(name: str, **options: Any) -> Any:
        return dramatiq.actor(broker=broker, actor_name=name, queue_name=queue, **options)

    def attempt() -> int:
        return int(CurrentMessage.get_current_message().options.get("retries", 0))

    def body(key: str, n: int, seconds: float) -> None:
        record("start", n, key, str(attempt()))
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # short sleeps: TimeLimit's interrupt lands between them
            time.sleep(0.02)
        record("end", n, key, str(attempt()))

    # TimeLimit (400 ms): the first attempt runs 3 s and is interrupted, a retry 0.1 s.
    @actor("limited", key="tl:{feed}", ttl=30, time_limit=400, max_retries=1,
           min_backoff=300, max_backoff=300)  # fmt: skip
    def limited(feed: str, n: int) -> None:
        body(f"tl:{feed}", n, 3.0 if attempt() == 0 else 0.1)

    # AgeLimit: sent with max_age, dropped before they run.
    @actor("aged_queue", key="ageq:{feed}", lock="queue", ttl=30)
    def aged_queue(feed: str, n: int) -> None:
        body(f"ageq:{feed}", n, 0.1)

    @actor("aged_both", key="ageb:{feed}", lock="queue_and_run", ttl=30)
    def aged_both(feed: str, n: int) -> None:
        body(f"ageb:{feed}", n, 0.1)

    # Retries: a busy key retried every 0.3 s, at most twice; a body failing twice.
    @actor("busy", key="busy:{feed}", ttl=10, on_conflict="retry", retry_countdown=0.3,
           max_retries=2)  # fmt: skip
    def busy(feed: str, n: int) -> None:
        body(f"busy:{feed}", n, 0.1)

    @actor("flaky", key="flaky:{feed}", ttl=10, max_retries=3, min_backoff=200, max_backoff=200)
    def flaky(feed: str, n: int) -> None:
        body(f"flaky:{feed}", n, 0.1)
        if attempt() < 2:
            raise RuntimeError(f"attempt {attempt()} fails")

    # Pipelines and Callbacks: a step skipped or retried on a busy key.
    @actor("step", key="pipe:{feed}", ttl=10, max_retries=0)
    def step(feed: str, n: int) -> None:
        body(f"pipe:{feed}", n, 0.1)

    @actor("step_retry", key="pipe:{feed}", ttl=10, on_conflict="retry", retry_countdown=0.3,
           max_retries=20)  # fmt: skip
    def step_retry(feed: str, n: int) -> None:
        body(f"pipe:{feed}", n, 0.1)

    @actor("noted", max_retries=0)
    def noted(message: dict[str, Any], result: Any) -> None:  # Callbacks' and a group's
        record("callback", message["args"][1])

    # A group of one key's messages: each waits for the key.
    @actor("waiter", key="grp:{feed}", ttl=10, on_conflict="wait", wait_timeout=20)
    def waiter(feed: str, n: int) -> None:
        body(f"grp:{feed}", n, 0.3)

    actors = (limited, aged_queue, aged_both, busy, flaky, step, step_retry, noted, waiter)
    return broker, {a.actor_name: a for a in actors}


if "TG_MEET_BROKER" in os.environ:
    broker, actors = make(os.environ["TG_MEET_BROKER"], os.environ["TG_MEET_QUEUE"])
    dramatiq.set_broker(broker)
