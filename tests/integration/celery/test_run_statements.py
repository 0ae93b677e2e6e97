"""What one delivery of a queue-phase message costs the lock database, counted
statement by statement, and what a second delivery of the same message does.

The run is driven in-process the way a worker drives it (a request that is not
eager, carrying the publisher's lease in taskguard's header), on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from taskguard import TaskGuard, guarded_task
from taskguard.celery.message import HEADER, Header, carry
from taskguard.config import guard_for, reset_guards


@pytest.fixture
def app(pg_url: str) -> Iterator[Celery]:
    app = Celery("tg_statements", broker="memory://", set_as_current=False)
    app.conf.update(taskguard_database_url=pg_url)
    yield app
    reset_guards()


def _deliver(task: Any, header: Any, task_id: str) -> list[str]:
    """Run ``task`` once as a delivery of ``task_id``; the SQL it sent."""
    store = guard_for(task._get_app())._store
    run = store._db.run
    sent: list[str] = []

    def counted(stmt: Any, values: Any, deadline: float | None = None) -> Any:
        sent.append(stmt.sql)
        return run(stmt, values, deadline)

    store._db.run = store.run = counted
    task.push_request(
        id=task_id,
        is_eager=False,
        called_directly=False,
        hostname="w1@host",
        headers={HEADER: header},
        retries=0,
    )
    try:
        task()
    finally:
        task.pop_request()
        del store._db.run
        store.run = store._db.run
    return sent


@pytest.mark.parametrize("form", ["compact", "dict"])
@pytest.mark.parametrize(("lock", "statements"), [("queue_and_run", 2), ("queue", 2)])
def test_a_delivery_of_a_queued_message(app: Celery, lock: str, statements: int, form: str) -> None:
    """``form``: the header as published now (one string, the key and the compact
    lease), or as a version before it published it (a dict with ``Lease.to_dict()``),
    still queued during a rolling upgrade: the same run either way."""
    ran: list[int] = []

    @guarded_task(app=app, shared=False, key="k", ttl=30, lock=lock)
    def job() -> None:
        ran.append(1)

    guard: TaskGuard = guard_for(app)
    lease = guard.acquire("k", 30, task_name=job.name, task_id="tid")  # the publisher's
    assert lease is not None
    header: Any = {"v": 1, "key": "k", "via": "enqueue", "lease": lease.to_dict()}
    if form == "compact":
        header = Header("k", lease=carry(lease)).to_message()
        assert header == f"k\x00{carry(lease)}"
    sent = _deliver(job, header, "tid")
    assert ran == [1]
    # queue_and_run: the adoption (under the run's own owner id) and the release with
    # the finished record. queue: the queued lease's release and the finished record.
    # Neither reads the finished record: the first delivery to take or end the
    # carried lease is the first of its message to start.
    assert len(sent) == statements, sent
    assert guard.held("k") == []
    # The same message again (a broker redelivery): dropped, not run.
    with pytest.raises(Ignore):
        _deliver(job, header, "tid")
    assert ran == [1]


def test_a_run_phase_delivery_sends_two_statements(app: Celery) -> None:
    """lock="run": the pool process's lean acquire (refused while the task id's
    finished record is held) and its release, which takes that record."""
    ran: list[int] = []

    @guarded_task(app=app, shared=False, key="r", ttl=30, lock="run")
    def job() -> None:
        ran.append(1)

    sql = guard_for(app)._store._sql
    sent = _deliver(job, {"v": 1, "key": "r", "via": "enqueue"}, "tid-run")
    assert ran == [1]
    assert sql.acquire_unless_lean is not None and sql.release_marking is not None
    assert sent == [sql.acquire_unless_lean.sql, sql.release_marking.sql]
    # A second delivery of the finished task id: the lean acquire grants nothing (the
    # record is held), the full one reads the record as the holder: dropped, not run.
    with pytest.raises(Ignore):
        _deliver(job, {"v": 1, "key": "r", "via": "enqueue"}, "tid-run")
    assert ran == [1]
