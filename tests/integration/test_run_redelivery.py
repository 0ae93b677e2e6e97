"""Another delivery of the job that holds the key (the core run, taskguard/runs.py):
not a duplicate. It waits for that lease to end, then runs, or is dropped as a late
copy if that delivery finished meanwhile; a different job on the key is still a
conflict. On every store, through GuardedRun as django.tasks, Dramatiq and taskiq use
it (tests/integration/dramatiq/test_dramatiq_workers.py: a SIGKILLed worker's message
on RabbitMQ)."""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

from taskguard import TaskGuard
from taskguard.options import Framework
from taskguard.results import is_skipped
from taskguard.runs import GuardedRun, GuardSpec


def fetch(feed: str) -> None:
    pass


SPEC = GuardSpec.of(fetch, Framework("test"), {"key": "redelivery:{feed}", "ttl": 30})
APP = SimpleNamespace(conf={"taskguard_finished_retention": 60})


def _run(guard: TaskGuard, feed: str, job: str) -> GuardedRun:
    return GuardedRun(SPEC, APP, (feed,), {}, task_id=job, redelivers=True, guard=guard)


def test_a_copy_of_the_holding_job_runs_once_its_lease_ends(guard: TaskGuard) -> None:
    feed, job = uuid.uuid4().hex, uuid.uuid4().hex
    # The dead first delivery's lease: 1.5 s left, under the job's own id.
    dead = guard.try_acquire(f"redelivery:{feed}", 1.5, task_name=SPEC.name, task_id=job)
    assert dead.lease is not None
    started = time.monotonic()
    assert _run(guard, feed, job).run(lambda: "ran") == "ran"
    assert time.monotonic() - started >= 1.0  # after the dead lease, not before


def test_a_copy_is_dropped_when_the_holding_delivery_finished(guard: TaskGuard) -> None:
    feed, job = uuid.uuid4().hex, uuid.uuid4().hex
    first = _run(guard, feed, job)
    assert first.start()
    copy = _run(guard, feed, job)
    # The first delivery finishes while the copy waits: its finished record refuses it.
    threading.Timer(0.5, first.release, kwargs={"final": True}).start()
    started = time.monotonic()
    try:
        assert copy.start() is False
        assert is_skipped(copy.outcome)  # dropped as a late copy: the body never runs
        # As soon as the finished record is seen, not when the wait (the ttl) runs out.
        assert time.monotonic() - started < 15
    finally:
        first.exit()  # this thread's run no more (the timer's thread released it)


def test_another_job_on_the_key_is_still_a_conflict(guard: TaskGuard) -> None:
    feed = uuid.uuid4().hex
    first = _run(guard, feed, uuid.uuid4().hex)
    assert first.start()
    try:
        started = time.monotonic()
        other = _run(guard, feed, uuid.uuid4().hex)
        assert other.start() is False  # skipped at once (on_conflict="skip"), no wait
        assert time.monotonic() - started < 10
    finally:
        first.exit()
