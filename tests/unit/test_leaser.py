"""The worker main process's lease thread (taskguard.celery.leaser) when the lock
database cannot be reached: every request of the batch comes back without a grant
(its pool process then acquires, and fails closed, itself), on the loop's side of
the result pipe, and the thread stops cleanly."""

from __future__ import annotations

import select
import time
from typing import Any

from celery import Celery

from taskguard.celery.leaser import Granted, Leaser
from taskguard.config import reset_guards
from taskguard.lease import LeaseRequest


class _Hub:
    """The two things the thread needs of kombu's hub: a reader per fd."""

    def __init__(self) -> None:
        self.readers: dict[int, Any] = {}

    def add_reader(self, fd: int, callback: Any) -> None:
        self.readers[fd] = callback


def test_an_unreachable_database_hands_every_request_back_ungranted() -> None:
    app = Celery("leaser_test", set_as_current=False)
    # Port 1 on loopback: connection refused at once (no server needed).
    app.conf.taskguard_database_url = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    app.conf.taskguard_call_timeout = 2.0
    hub = _Hub()
    delivered: list[Granted] = []
    leaser = Leaser(app, hub, delivered.append)
    leaser.start()
    try:
        items = ["first", "second"]
        leaser.grant(items, [LeaseRequest("a", 30), LeaseRequest("b", 30)])
        ((fd, on_done),) = hub.readers.items()
        deadline = time.monotonic() + 10
        while not delivered and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                on_done()
        assert delivered, "the batch never came back"
        (batch,) = delivered
        assert batch[0] == items and batch[1] == [None, None]
    finally:
        leaser.stop(timeout=10)
        reset_guards()
    assert not leaser.is_alive()
