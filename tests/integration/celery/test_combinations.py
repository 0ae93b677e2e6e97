"""Where taskguard's Celery features meet each other (issue 28): coalesce and
debounce members of canvases, a queue lock with conflict retries, two tasks with
pending runs on one key, a killed waiter, and the combination matrix (every
``lock=`` x ``on_conflict=`` x canvas shape), with real prefork workers; the matrix
also on each other worker pool (threads, solo, gevent, eventlet: fewer shapes).

One worker per lock store and broker serves the whole module (``menv``); every
case uses keys of its own, so cases run side by side.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery import chain, chord, group
from celery.result import GroupResult
from conftest import AMQP_URL, REDIS_URL
from harness import wait_for
from pending_harness import PendingEnv, running_env, runs
from sqlalchemy import select
from tg_matrix_app import CONFIGS, INVALID, make_app
from workers import start_worker

from taskguard import AlreadyLocked, guarded_task, is_skipped
from taskguard.celery.pending import is_coalesced
from taskguard.celery.rate import rate_key
from taskguard.exceptions import ConfigurationError
from taskguard.lease import Lease
from taskguard.models import TaskLock
from taskguard.waiting import RESERVATION

pytestmark = [pytest.mark.celery, pytest.mark.postgres]

#: (lock store, broker) of each worker the module starts.
ENVS = [("postgresql", "redis"), ("postgresql", "amqp"), ("sqlite", "redis"), ("mariadb", "redis")]
BROKER_URLS = {"redis": REDIS_URL, "amqp": AMQP_URL}
#: Longest any canvas may take to finish (a loaded 2-core machine).
BOUND = 60.0


@pytest.fixture(scope="module", params=ENVS, ids=[f"{s}-{b}" for s, b in ENVS], name="menv")
def matrix_env(request: pytest.FixtureRequest) -> Iterator[PendingEnv]:
    store, broker = request.param
    with running_env(
        request, store, app_module="tg_matrix_app", app_factory=make_app, broker=broker,
        broker_url=BROKER_URLS[broker], concurrency=8,
    ) as env:  # fmt: skip
        yield env


# -- declaration -------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_combinations_are_refused_at_declaration(case: str) -> None:
    with pytest.raises(ConfigurationError, match=f"task tgm.bad.{case}"):

        @guarded_task(name=f"tgm.bad.{case}", key="m:{key_id}", **INVALID[case])
        def bad(key_id: str) -> None: ...


# -- A: coalesce and debounce members of canvases ------------------------------------------


def test_coalesced_chord_members_do_not_hang_the_chord(menv: PendingEnv) -> None:
    kid = menv.key_id("chord")
    member = menv.task("tgm.run-coalesce")
    sig = chord(
        [member.s(key_id=kid, note=f"n{i}", duration=1.0) for i in range(3)],
        menv.task("tgm.collect").s(),
    )
    result = sig.apply_async()
    values = result.get(timeout=30)
    # n0 is the pending run and runs for 1 s. n1 and n2, published milliseconds
    # later, merge into it, or (when n0 had already started and given its pending
    # place up) one of them becomes the next pending run and the other merges into
    # that one. Either way every member ends, with its value or the marker.
    ids = [r.id for r in result.parent.results]
    ran = [v for v in values if not is_coalesced(v)]
    assert values[0] == "n0" and len(ran) <= 2, values
    assert all(v == f"n{i}" or is_coalesced(v) for i, v in enumerate(values)), values
    assert all(v["into"] in ids for v in values if is_coalesced(v)), values
    assert [r.note for r in runs(menv, kid)] == ran


def test_a_chain_whose_first_link_merges_into_a_pending_run_goes_on(menv: PendingEnv) -> None:
    kid = menv.key_id("chain")
    task = menv.task("tgm.run-coalesce")
    task.delay(key_id=kid, note="running", duration=2.0)
    wait_for(lambda: runs(menv, kid), 20, "the first run")
    pending = task.delay(key_id=kid, note="pending")
    result = chain(task.s(key_id=kid, note="chained"), menv.task("tgm.echo").s()).apply_async()
    value = result.get(timeout=30)
    assert is_coalesced(value) and value["into"] == pending.id, value
    assert pending.get(timeout=30) == "pending"
    assert [r.note for r in runs(menv, kid)] == ["running", "pending"]


def test_debounced_chord_members_do_not_hang_the_chord(menv: PendingEnv) -> None:
    kid = menv.key_id("debounce-chord")
    member = menv.task("tgm.run-debounce")
    sig = chord(
        [member.s(key_id=kid, note=f"n{i}") for i in range(3)], menv.task("tgm.collect").s()
    )
    values = sig.apply_async().get(timeout=30)
    assert values[2] == "n2", values
    assert all(is_coalesced(v) for v in values[:2]), values
    assert [r.note for r in runs(menv, kid)] == ["n2"]


# -- B: lock="queue" with on_conflict="retry" ------------------------------------------------


def test_a_queue_lock_conflict_retried_in_the_worker_is_checked_again(menv: PendingEnv) -> None:
    kid = menv.key_id("queue-retry")
    task = menv.task("tgm.queue-retry")
    first = task.apply_async(kwargs={"key_id": kid, "note": "a"}, countdown=3)
    began = time.monotonic()
    second = task.apply_async(kwargs={"key_id": kid, "note": "b"})
    assert second.get(timeout=30) == "b" and first.get(timeout=30) == "a"
    found = {r.note: r for r in runs(menv, kid)}
    # b met a's queue lock and was put off until a left the queue (a started).
    assert found["b"].started_at >= found["a"].started_at, found
    assert time.monotonic() - began >= 3.0


# -- issue 27 item 4: two tasks with pending runs on one key ----------------------------


def test_a_coalesced_submission_never_merges_into_another_tasks_pending_run(
    menv: PendingEnv,
) -> None:
    url = menv.key_id("feed")
    imports, reindex = menv.task("tgm.import_feed"), menv.task("tgm.reindex_feed")
    first = imports.delay(url)
    time.sleep(0.5)
    debounced = reindex.delay(url, [1])
    time.sleep(0.2)
    second = imports.delay(url)
    assert not is_coalesced(second.result), second.result
    assert first.get(timeout=30) == "import"
    assert debounced.get(timeout=30) == "reindex"
    assert second.get(timeout=30) == "import"
    found = runs(menv, url)
    assert sorted(r.note for r in found) == ["import", "import", "reindex"], found


# -- revoke in the pending window -----------------------------------------------------------


def test_a_submission_after_the_pending_run_was_revoked_runs(menv: PendingEnv) -> None:
    """Issue 33, defect 9: the pending run is revoked while its deferred copy waits in
    the worker's ETA timer; a submission made right after the worker received the
    revoke becomes the new pending run and runs. It used to merge into the revoked
    run (a coalesced marker naming it) and never run: the place was given back only
    when the copy's countdown ended."""
    node = f"{menv.worker.queue}@{socket.gethostname()}"  # workers.start_worker's -n
    task = menv.task("tgm.run-coalesce")
    for trial in range(3):
        kid = menv.key_id(f"revoked-pending-{trial}")
        holder = menv.guard.acquire(f"m:{kid}", 30, task_name="holder")
        assert holder is not None
        doomed = task.delay(key_id=kid, note="revoked")
        time.sleep(1.0)  # its deferred copy waits in the worker's ETA timer
        replies = menv.app.control.revoke(
            doomed.id, destination=[node], reply=True, timeout=10, limit=1
        )
        assert replies, "the worker did not answer the revoke"
        after = task.delay(key_id=kid, note="after")
        early = after.result if isinstance(after.result, dict) else None
        assert not is_coalesced(early), f"trial {trial}: merged into the revoked run: {early}"
        assert menv.guard.release(holder)
        assert after.get(timeout=BOUND) == "after"
        assert [r.note for r in runs(menv, kid)] == ["after"]


# -- E: a SIGKILLed waiter -----------------------------------------------------------------


def _next_owner(env: PendingEnv, key: str) -> str | None:
    with env.guard.engine.connect() as conn:
        return conn.execute(select(TaskLock.next_owner).where(TaskLock.key == key)).scalar()


def _pool_pid(env: PendingEnv, task_id: str) -> int:
    """The pool process running ``task_id`` (Celery's remote control)."""
    node = f"{env.worker.queue}@{socket.gethostname()}"  # workers.start_worker's -n
    inspect = env.app.control.inspect(destination=[node], timeout=10, limit=1)
    for tasks in (inspect.active() or {}).values():
        for task in tasks:
            if task["id"] == task_id:
                return int(task["worker_pid"])
    raise AssertionError(f"{task_id} is not running")


def test_a_killed_waiting_pool_process_stops_holding_up_the_key(menv: PendingEnv) -> None:
    kid = menv.key_id("killed-waiter")
    key = f"m:{kid}"
    holder = menv.guard.acquire(key, 30, task_name="holder")
    assert holder is not None
    doomed = menv.task("tgm.run-wait").delay(key_id=kid, note="killed")
    wait_for(lambda: _next_owner(menv, key), 30, "the waiter to be in line")
    os.kill(_pool_pid(menv, doomed.id), signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        doomed.get(timeout=30)
    time.sleep(RESERVATION + 1.0)
    # The key is free for anyone right after a release (the dead waiter's
    # reservation kept it for RESERVE_GRACE after every release, up to its wait_timeout).
    assert menv.guard.release(holder)
    taken = menv.guard.acquire(key, 30, task_name="skip")
    assert taken is not None, "the killed waiter's reservation still holds the key"
    # A live waiter gets the key when it is released.
    live = menv.task("tgm.run-wait").delay(key_id=kid, note="live")
    wait_for(lambda: _next_owner(menv, key), 30, "the live waiter to be in line")
    released_at = datetime.now(timezone.utc)
    assert menv.guard.release(taken)
    assert live.get(timeout=30) == "live"
    (run,) = runs(menv, kid)
    print(f"{menv.store}: handed over {(run.started_at - released_at).total_seconds():.3f}s")


# -- G: a whole worker SIGKILLed with a pending and a debounced run in hand --------------

#: Redis: the visibility timeout the killed-worker test sets (kombu's default: 1 h).
VISIBILITY = 3.0


# slow: also kept out of the lowest-versions pass, whose kombu does not restore
# Redis's unacked messages within the test (scripts/min_versions.sh).
@pytest.mark.slow
@pytest.mark.parametrize("broker", ["amqp", "redis"])
def test_a_killed_worker_loses_no_pending_or_debounced_run(
    request: pytest.FixtureRequest, broker: str
) -> None:
    """The whole worker is SIGKILLed while it holds the pending run's deferred copy
    and a debounced message (both ETA messages it has not acknowledged): each runs
    once when the broker hands it out again: RabbitMQ at once (the connection
    died), Redis after its visibility timeout."""
    extra = {"TASKGUARD_TEST_VISIBILITY_TIMEOUT": str(VISIBILITY)} if broker == "redis" else {}
    with running_env(
        request, "postgresql", app_module="tg_matrix_app", app_factory=make_app, broker=broker,
        broker_url=BROKER_URLS[broker], concurrency=2, worker_env=extra,
    ) as env:  # fmt: skip
        coalesced, feed = env.key_id("killed-pending"), env.key_id("killed-debounced")
        task = env.task("tgm.run-coalesce")
        task.delay(key_id=coalesced, note="holder", duration=30.0)
        wait_for(lambda: runs(env, coalesced), 30, "the holder's run")
        task.delay(key_id=coalesced, note="pending")
        time.sleep(1.5)  # the pending run is deferred while the key is held
        env.task("tgm.reindex_feed").delay(feed, [1])  # debounce=1
        time.sleep(0.3)
        killed_at = datetime.now(timezone.utc)
        env.worker.kill()
        with start_worker(
            "tg_matrix_app", BROKER_URLS[broker], env.lock_url, 2, queue=env.worker.queue,
            result_backend=REDIS_URL, env={"TG_RUNS_URL": env.runs_url, **extra}, purge=False,
        ):  # fmt: skip
            ready = (datetime.now(timezone.utc) - killed_at).total_seconds()
            wait_for(lambda: len(runs(env, coalesced)) == 2 and runs(env, feed), 60, "both runs")
            time.sleep(2.0)  # a second copy would have run by now
        pending, debounced = runs(env, coalesced)[1:], runs(env, feed)
    assert [r.note for r in pending] == ["pending"] and [r.note for r in debounced] == ["reindex"]
    after = [round((r[0].started_at - killed_at).total_seconds(), 2) for r in (pending, debounced)]
    print(
        f"{broker}: second worker ready {ready:.2f}s after the kill; pending, debounced ran {after}s after it"
    )
    if broker == "redis":
        assert min(after) >= VISIBILITY - 1.0, after  # not before the visibility timeout


# -- the combination matrix ------------------------------------------------------------------

#: Canvas shapes; each puts members of one case's key in a canvas.
SHAPES = ("chord", "group", "chain-first", "chain-middle")
#: Each case's key is held when the case is submitted, by a lease this long,
#: released by the test as soon as the conflict is logged (in this process or the
#: worker's log): every case meets a held key, whenever its member reaches it.
HOLD = 30.0
#: With rate=, the rate window is full instead, for this long: a start over the
#: rate is put off until the first slot's end, which a release does not move.
#: (8 s ran out on a loaded 2-core machine before every case had been submitted.)
RATE_HOLD = 20.0


def allowed(case: str) -> set[str]:
    """What a member of ``case`` may end as (besides running)."""
    options = CONFIGS[case]
    strategy = options.get("on_conflict", "skip")
    if options.get("debounce") or strategy == "coalesce":
        return {"ran", "coalesced"}
    if strategy in ("retry", "wait"):
        return {"ran"}
    if strategy == "raise":
        return {"ran", "AlreadyLocked", "refused at apply_async"}
    return {"ran", "skipped"}  # skip, and existing (a canvas cannot wait on another task)


@dataclass
class Case:
    case: str
    shape: str
    kid: str
    holders: list[Lease]
    submitted: float
    members: list[Any]  # AsyncResult per member (empty when refused at apply_async)
    final: Any  # what the caller waits on, or the exception apply_async raised
    outcome: str = ""
    took: float = 0.0


def _hold(env: PendingEnv, case: str, kid: str) -> list[Lease]:
    """Every slot of the case's key, or of its rate window with rate=."""
    key, options, ttl = f"m:{kid}", CONFIGS[case], HOLD
    limit = options.get("limit", 1)
    if "rate" in options:
        key, limit, ttl = rate_key(key), int(options["rate"].split("/")[0]), RATE_HOLD
    details = {"task_name": "holder", "task_id": f"holder-{kid}", "limit": limit}
    leases = [env.guard.acquire(key, ttl, **details) for _ in range(limit)]
    assert all(leases), leases
    return [lease for lease in leases if lease is not None]


def _submit(env: PendingEnv, case: str, shape: str) -> Case:
    kid = env.key_id(f"{case}-{shape}")
    task, echo = env.task(f"tgm.{case}"), env.task("tgm.echo")
    holders = _hold(env, case, kid)
    members = [task.s(key_id=kid, note=f"n{i}") for i in range(3 if shape in SHAPES[:2] else 1)]
    sig: Any
    if shape == "chord":
        sig = chord(members, env.task("tgm.collect").s())
    elif shape == "group":
        sig = group(members)
    elif shape == "chain-first":
        sig = chain(members[0], echo.s())
    else:
        sig = chain(echo.s("start"), members[0], echo.s())
    submitted = time.monotonic()
    try:
        final = sig.apply_async()
    except AlreadyLocked as exc:
        return Case(case, shape, kid, holders, submitted, [], exc)
    if shape == "chord":
        results = list(final.parent.results)
    elif shape == "group":
        results = list(final.results)
    else:
        results = [final.parent]
    return Case(case, shape, kid, holders, submitted, results, final)


def _member(result: Any, note: str) -> str:
    if not result.ready():
        return "unfinished"
    if result.state == "FAILURE":
        return type(result.result).__name__
    value = result.result
    if value == note:
        return "ran"
    if is_skipped(value):
        return "skipped"
    if is_coalesced(value):
        return "coalesced"
    return f"value {value!r}"


def _finished(case: Case) -> bool:
    if isinstance(case.final, BaseException):
        return True
    return bool(case.final.ready()) or any(r.state == "FAILURE" for r in _links(case))


def _links(case: Case) -> list[Any]:
    """Every task result of the case's canvas the caller can reach."""
    found, node = [], case.final
    while node is not None:
        found += list(node.results) if isinstance(node, GroupResult) else [node]
        node = node.parent
    return found


def _state(final: Any) -> str:
    if isinstance(final, BaseException):
        return f"raised {type(final).__name__}"
    if isinstance(final, GroupResult):
        return "FAILURE" if final.failed() else "SUCCESS" if final.ready() else "PENDING"
    return str(final.state)


def _describe(case: Case) -> list[str]:
    if isinstance(case.final, BaseException):
        return ["refused at apply_async"]
    return [_member(r, f"n{i}") for i, r in enumerate(case.members)]


def _overlaps(env: PendingEnv, case: Case) -> list[str]:
    """Moments more runs of the case's key ran than its lock allows."""
    options = CONFIGS[case.case]
    if options["lock"] == "queue":
        return []  # runs are not locked under lock="queue" (by design)
    limit, found = options.get("limit", 1), runs(env, case.kid)
    bad = []
    for run in found:
        assert run.ended_at is not None, f"{case.case}/{case.shape}: a run never ended"
        during = [r for r in found if r.started_at <= run.started_at < r.ended_at]  # type: ignore[operator]
        if len(during) > limit:
            bad.append(f"{len(during)} runs at {run.started_at}")
    return bad


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.slow  # once per CI run: the latest-versions pass
def test_combination_matrix(menv: PendingEnv) -> None:
    """Every valid combination in every canvas shape, side by side on keys of their
    own, each meeting a held key: each finishes within BOUND with a value or a
    visible error, each member ends as its strategy says, and no key runs more often
    at once than its limit."""
    _run_matrix(menv, SHAPES)


#: The pools a user can choose besides prefork (menv's): -c and the canvas shapes of
#: each one's matrix (solo runs one task at a time: one member per case).
POOLS = {
    "threads": (8, ("group", "chain-first")),
    "gevent": (20, ("group", "chain-first")),
    "eventlet": (20, ("group", "chain-first")),
    "solo": (1, ("chain-first",)),
}


@pytest.fixture(scope="module", params=list(POOLS), name="pool_env")
def pool_env(request: pytest.FixtureRequest) -> Iterator[PendingEnv]:
    with running_env(
        request, "postgresql", app_module="tg_matrix_app", app_factory=make_app,
        concurrency=POOLS[request.param][0], pool=request.param,
    ) as env:  # fmt: skip
        yield env


@pytest.mark.slow  # once per CI run: the latest-versions pass
def test_combination_matrix_on_each_pool(pool_env: PendingEnv) -> None:
    """The matrix (fewer shapes) on every other worker pool, locks in PostgreSQL."""
    _run_matrix(pool_env, POOLS[pool_env.pool][1])


def _run_matrix(menv: PendingEnv, shapes: tuple[str, ...]) -> None:
    logger, lines = logging.getLogger("taskguard"), _Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        cases = [_submit(menv, case, shape) for case in CONFIGS for shape in shapes]
        deadline = cases[0].submitted + BOUND
        unfinished, holding = list(cases), list(cases)
        while unfinished and time.monotonic() < deadline:
            logged = "\n".join(lines.lines) + menv.worker.log_text()
            for case in [c for c in holding if f"'m:{c.kid}'" in logged]:
                holding.remove(case)
                for lease in case.holders:
                    assert menv.guard.release(lease)
            for case in [c for c in unfinished if _finished(c)]:
                case.took = time.monotonic() - case.submitted
                unfinished.remove(case)
            time.sleep(0.1)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    time.sleep(1.0)  # members answered before their canvas's end report it by now
    problems = [
        f"{c.case}/{c.shape}: met no conflict (nothing logged for its key)" for c in holding
    ]
    outcomes: Counter[str] = Counter()
    for case in cases:
        members = _describe(case)
        outcomes.update(members)
        where = f"{case.case}/{case.shape}"
        if case in unfinished:
            problems.append(f"{where}: unfinished after {BOUND:.0f}s ({members})")
        if not set(members) <= allowed(case.case) | {"ran"}:
            problems.append(f"{where}: members ended as {members}")
        problems += [f"{where}: {o}" for o in _overlaps(menv, case)]
        case.outcome = f"{_state(case.final)}: {', '.join(members)}"
    slowest = max(cases, key=lambda c: c.took)
    print(
        f"\n{menv.store}/{menv.broker}/{menv.pool}: {len(cases)} cases, members {dict(outcomes)}; "
        f"slowest {slowest.case}/{slowest.shape} {slowest.took:.1f}s"
    )
    for case in sorted(cases, key=lambda c: (list(CONFIGS).index(c.case), c.shape)):
        print(f"  {case.case:24} {case.shape:13} {case.took:5.1f}s  {case.outcome}")
    assert not problems, "\n".join(problems)
