"""The lock phase and the key's limit a row records (issue 44), on every database:
an enqueue's lease is in phase queue until its run adopts it (run); a run's own
acquire is run; a plain acquire records no phase; every grant records its limit;
rows written before the columns existed read as not recorded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from taskguard import TaskGuard
from taskguard.options import CELERY, Phase
from taskguard.runs import GuardedRun, GuardSpec, enqueue_locked


def job(item: str) -> None:
    """A guarded job's signature (its body is the test's)."""


@pytest.fixture
def guard(db_url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(db_url)
    yield g
    g.dispose()


def _spec(**options: object) -> GuardSpec:
    return GuardSpec.of(job, CELERY, {"key": "job:{item}", "ttl": 60, **options}, name="t.job")


def test_an_enqueue_is_in_phase_queue_until_its_run_adopts_it(guard: TaskGuard) -> None:
    spec = _spec(lock="queue_and_run")
    handle = enqueue_locked(spec, None, (), {"item": "a"}, lambda: "job-1", job_id=str, guard=guard)
    assert handle == "job-1"
    (queued,) = guard.get_all("job:a")
    # Named after the publish (task_id unknown before it): the phase stays queue.
    assert (queued.phase, queued.slots, queued.task_id) == (Phase.QUEUE, 1, "job-1")
    assert queued.phase is Phase.QUEUE  # a Phase, as the core compares it

    seen: list[tuple[object, int | None, str]] = []

    def body() -> str:
        (row,) = guard.get_all("job:a")
        seen.append((row.phase, row.slots, row.owner))
        return "ran"

    run = GuardedRun(spec, None, (), {"item": "a"}, task_id="job-1", guard=guard)
    assert run.run(body) == "ran"
    assert seen == [(Phase.RUN, 1, seen[0][2])] and seen[0][2] != queued.owner  # adopted
    (after,) = guard.get_all("job:a")
    assert (after.phase, after.token, after.held) == (Phase.RUN, queued.token, False)


def test_a_runs_own_acquire_is_run_and_records_the_limit(guard: TaskGuard) -> None:
    phases = []
    for item, options in (("b1", {}), ("b3", {"limit": 3})):
        run = GuardedRun(_spec(**options), None, (), {"item": item}, task_id="r", guard=guard)
        run.run(lambda key=run.key: phases.extend(
            (i.phase, i.slots) for i in guard.get_all(key) if i.held
        ))  # fmt: skip
    assert phases == [(Phase.RUN, 1), (Phase.RUN, 3)]


def test_a_plain_acquire_records_its_limit_and_no_phase(guard: TaskGuard) -> None:
    assert guard.acquire("plain", 60) is not None
    for _ in range(2):
        assert guard.acquire("limited", 60, limit=3) is not None
    assert [(i.phase, i.slots) for i in guard.get_all("plain")] == [(None, 1)]
    assert [(i.phase, i.slots) for i in guard.get_all("limited")] == [(None, 3)] * 2
    first = guard.try_acquire("queued", 60, phase=Phase.QUEUE).lease
    assert first is not None
    # A takeover of an ended row writes its own phase and limit over the old ones.
    assert guard.release(first)
    assert guard.acquire("queued", 60, limit=2) is not None
    assert [(i.phase, i.slots) for i in guard.get_all("queued") if i.held] == [(None, 2)]
    listed = {(i.key, i.phase, i.slots) for i in guard.held()}
    assert ("plain", None, 1) in listed and ("limited", None, 3) in listed


def test_rows_from_before_the_columns_read_as_not_recorded(db_url: str, guard: TaskGuard) -> None:
    assert guard.try_acquire("old", 60, phase=Phase.RUN).lease is not None
    engine = create_engine(db_url)
    with engine.begin() as conn:  # as tg0002 left it: no phase, no limit
        conn.execute(text("UPDATE task_locks SET phase = NULL, slots = NULL"))
    (info,) = guard.get_all("old")
    assert (info.phase, info.slots, info.held) == (None, None, True)
    assert info.to_dict()["phase"] is None and info.to_dict(1)["slots_in_use"] == 1
    with engine.begin() as conn:  # a phase a later version writes: not one of ours
        conn.execute(text("UPDATE task_locks SET phase = 'later'"))
    engine.dispose()
    assert guard.get_all("old")[0].phase is None
