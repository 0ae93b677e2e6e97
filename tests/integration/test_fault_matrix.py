"""The fault matrix (issue 28): database stopped, database frozen (SIGSTOP), network
partition through a proxy, worker SIGKILL, pool process SIGKILL x lock="run",
lock="queue_and_run", on_conflict="coalesce", debounce, on_conflict="wait".

Real servers and workers: a private PostgreSQL cluster holds the locks (the tests
stop, freeze and crash it; never the shared server), worker A reaches it through a
TCP proxy the tests partition, worker B directly; both prefork, both consuming one
RabbitMQ queue, with ``acks_late`` + ``task_reject_on_worker_lost``. Every body
records its run in the shared server (fault_matrix_app.py). For each fault the five
phases run at once on keys of their own, three submissions each, the fault striking
while the first runs work. Then, per case:

* nothing overlaps: the runs of a key (completed, interrupted by a lost lease, or
  killed) never overlap by the record database's clock, and their fencing tokens
  grow in start order;
* nothing is lost: every submission ends in SUCCESS, as a run that completed under
  its lease or as the marker of one that covers it (coalesce, debounce), and every
  run, queue_and_run and wait submission completed a run of its own;
* nothing hangs: all of that within :data:`SETTLE` seconds of the fault ending.

The table printed at the end is the one in docs/evidence/reliability-runs.md ("The fault matrix").
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from conftest import AMQP_URL, REDIS_URL, drop_pg_database, new_pg_database
from fault_matrix_app import RUNS_DDL, TTL, make_app
from integration.celery.workers import Worker, start_worker, unique_queue
from sqlalchemy.engine import make_url

from taskguard import DatabaseUnavailable, schema
from taskguard.config import reset_guards
from taskguard.results import MARKER
from tests.harness.postgres import ThrowawayCluster
from tests.harness.proxy import FaultProxy

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MODES = ("run", "queue_and_run", "coalesce", "debounce", "wait")
FAULTS = ("db_stopped", "db_frozen", "partition", "worker_sigkill", "pool_sigkill")
#: FM_FAULTS=partition,db_frozen runs those rows only (a local run).
RUN_FAULTS = tuple(os.environ.get("FM_FAULTS", ",".join(FAULTS)).split(","))
#: Submissions per case.
SUBMISSIONS = 3
#: How long the database and network faults last (seconds): past the ttl, so the
#: running leases are lost and their keys taken by others.
HOLD = TTL + 2.0
#: Every submission must have ended this long after the fault ended.
SETTLE = 120.0


@dataclass
class Matrix:
    cluster: ThrowawayCluster
    proxy: FaultProxy
    app: Celery
    record_dsn: str
    lock_url: str
    proxied_url: str
    queue: str
    stack: contextlib.ExitStack
    workers: dict[str, Worker] = field(default_factory=dict)
    retired: list[Worker] = field(default_factory=list)

    def start_worker(self, name: str) -> Worker:
        url = self.proxied_url if name == "a" else self.lock_url
        worker = self.stack.enter_context(
            start_worker(
                "fault_matrix_app",
                AMQP_URL,
                url,
                3,
                queue=self.queue,
                result_backend=REDIS_URL,
                pythonpath=(HERE, HERE.parent),
                env={"FM_RECORD_DSN": self.record_dsn, "FM_WORKER": name},
                extra_args=("-n", f"{name}-{self.queue}@%h"),
                purge=False,
            )
        )
        self.workers[name] = worker
        return worker

    def records(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.record_dsn, autocommit=True) as conn:
            return conn.execute(sql, args).fetchall()


@pytest.fixture(scope="module")
def matrix() -> Iterator[Matrix]:
    record_url = new_pg_database(None)
    record_dsn = make_url(record_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(record_dsn, autocommit=True) as conn:
        conn.execute(RUNS_DDL)
    try:
        with ThrowawayCluster() as cluster, FaultProxy(cluster.port) as proxy:
            lock_url = cluster.create_database("locks")
            schema.upgrade(lock_url)
            queue = unique_queue("tg-fm")
            app = make_app(AMQP_URL, REDIS_URL, queue, lock_url)
            with contextlib.ExitStack() as stack:
                m = Matrix(
                    cluster,
                    proxy,
                    app,
                    record_dsn,
                    lock_url,
                    cluster.url("locks", port=proxy.port),
                    queue,
                    stack,
                )
                m.start_worker("a")
                m.start_worker("b")
                try:
                    yield m
                finally:
                    app.close()
                    reset_guards()
    finally:
        drop_pg_database(record_url)


# -- one round: a fault against the five phases at once ---------------------------------


@dataclass
class Case:
    fault: str
    mode: str
    k: str
    results: list[Any] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


def _submit(m: Matrix, fault: str) -> dict[str, Case]:
    tag = uuid.uuid4().hex[:6]
    cases = {mode: Case(fault, mode, f"{fault}-{mode}-{tag}") for mode in MODES}
    for n in range(SUBMISSIONS):
        for mode, case in cases.items():
            case.results.append(m.app.tasks[f"fm.{mode}"].apply_async((case.k, n)))
        time.sleep(0.15)
    return cases


def _running_pids(m: Matrix, keys: list[str], worker: str) -> list[int]:
    rows = m.records(
        "SELECT DISTINCT pid FROM fm_runs WHERE ended_at IS NULL AND worker = %s AND k = ANY(%s)",
        worker,
        keys,
    )
    return [int(r[0]) for r in rows]


def _mark_killed(m: Matrix, pids: list[int]) -> None:
    # A killed body runs no finally: it ended now, as far as exclusion is concerned.
    m.records(
        "UPDATE fm_runs SET ended_at = clock_timestamp(), outcome = 'killed' "
        "WHERE ended_at IS NULL AND pid = ANY(%s) RETURNING id",
        pids,
    )


def _inject(m: Matrix, fault: str, cases: dict[str, Case]) -> None:
    keys = [c.k for c in cases.values()]
    if fault == "db_stopped":
        m.cluster.crash()
        time.sleep(0.5)
        # Work delivered while the database is down (issue 28 D): a lock="run" submission
        # is published (no database at enqueue) and must run once the database is back;
        # a queue phase or a pending place cannot be taken, so apply_async fails at once,
        # visibly, and publishes nothing.
        cases["run"].results.append(m.app.tasks["fm.run"].apply_async((cases["run"].k, 9)))
        for mode in ("queue_and_run", "coalesce", "debounce"):
            with pytest.raises(DatabaseUnavailable):
                m.app.tasks[f"fm.{mode}"].apply_async((cases[mode].k, 9))
        time.sleep(HOLD - 0.5)
        m.cluster.start()
    elif fault == "db_frozen":
        m.cluster.freeze()
        time.sleep(HOLD)
        m.cluster.thaw()
    elif fault == "partition":
        m.proxy.freeze()
        m.proxy.cut_all()
        time.sleep(HOLD)
        m.proxy.thaw()
    elif fault == "worker_sigkill":
        pids = _running_pids(m, keys, "a")
        m.workers["a"].kill()
        _mark_killed(m, pids)
        m.retired.append(m.workers.pop("a"))
        time.sleep(1.0)
        m.start_worker("a")
    elif fault == "pool_sigkill":
        pids = _running_pids(m, keys, "a") or _running_pids(m, keys, "b")
        assert pids, "no body was running to kill"
        os.kill(pids[0], signal.SIGKILL)
        _mark_killed(m, pids[:1])
    else:  # pragma: no cover
        raise ValueError(fault)


def _outage_retries(m: Matrix, k: str) -> int:
    logs = [w.log_text() for w in [*m.workers.values(), *m.retired]]
    return sum(text.count(f"(outage): key 'fm:{k}'") for text in logs)


def _check(m: Matrix, case: Case, ended_by: float) -> None:
    values: dict[str, Any] = {}
    for res in case.results:
        try:
            values[res.id] = res.get(timeout=max(ended_by - time.monotonic(), 0.1))
        except Exception as exc:
            case.problems.append(f"{res.id}: {res.state} {exc!r}")
            case.counts["unfinished" if res.state == "PENDING" else "failed"] += 1
    runs = m.records(
        "SELECT task_id, token, started_at, ended_at, outcome FROM fm_runs WHERE k = %s "
        "ORDER BY started_at",
        case.k,
    )
    completed = {r[0] for r in runs if r[4] == "ok"}
    case.counts["submissions"] = len(case.results)
    case.counts["runs_completed"] = len(completed)
    case.counts["runs_lost_lease"] = sum(r[4] == "lost" for r in runs)
    case.counts["runs_killed"] = sum(r[4] == "killed" for r in runs)
    case.counts["outage_retries"] = _outage_retries(m, case.k)
    for before, after in itertools.pairwise(runs):
        if before[3] is None or before[3] > after[2]:
            case.counts["overlaps"] += 1
            case.problems.append(f"overlap: {before} / {after}")
        if after[1] is not None and before[1] is not None and after[1] <= before[1]:
            case.problems.append(f"token did not grow: {before} / {after}")
    into: dict[str, Any] = {}
    for task_id, value in values.items():
        if isinstance(value, dict) and MARKER in value:
            case.counts[f"marker_{value[MARKER]}"] += 1
            into[task_id] = value.get("into")
        elif isinstance(value, dict) and value.get("ran") == task_id:
            if task_id not in completed:
                case.problems.append(f"{task_id} returned without a completed run")
        else:
            case.problems.append(f"{task_id}: unexpected value {value!r}")
    for task_id, target in into.items():
        seen = {task_id}
        while target in into and target not in seen:
            seen.add(target)
            target = into[target]
        if target not in completed:
            case.problems.append(f"{task_id} is covered by {target!r}, which never completed")
    if case.mode in ("run", "queue_and_run", "wait"):
        missing = [r.id for r in case.results if r.id not in completed]
        if missing:
            case.problems.append(f"submissions that never completed a run: {missing}")


def _round(m: Matrix, fault: str) -> list[Case]:
    cases = _submit(m, fault)
    time.sleep(0.8)  # the first runs are working, the rest queued or pending
    _inject(m, fault, cases)
    ended_by = time.monotonic() + SETTLE
    for case in cases.values():
        _check(m, case, ended_by)
    return list(cases.values())


@pytest.mark.timeout(900)
def test_fault_matrix(matrix: Matrix) -> None:
    table: list[Case] = []
    for fault in RUN_FAULTS:
        table.extend(_round(matrix, fault))
    print()
    cols = (
        "submissions",
        "runs_completed",
        "runs_lost_lease",
        "runs_killed",
        "outage_retries",
        "marker_coalesced",
        "overlaps",
        "failed",
        "unfinished",
    )
    print("| fault | phase | " + " | ".join(c.replace("_", " ") for c in cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for case in table:
        row = " | ".join(str(case.counts.get(c, 0)) for c in cols)
        print(f"| {case.fault} | {case.mode} | {row} |")
    totals: Counter[str] = Counter()
    for case in table:
        totals.update(case.counts)
    print(f"cases: {len(table)}; totals: {dict(totals)}")
    problems = [f"{c.fault}/{c.mode}: {p}" for c in table for p in c.problems]
    assert not problems, "\n".join(problems)
