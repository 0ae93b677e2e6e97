"""Section 7: end to end shaped like a deployment (issue 29, target 3).

In production the lock database and the broker run on machines of their own and
the worker fleet is what grows with load. Here a private PostgreSQL cluster and a
private Redis (the broker, celery-once's lock store and the done-counters), each
started on a free port and stopped at the end, are pinned to one core with
``taskset``; the publisher (this process) and the workers to the other. The
trivial tasks of :mod:`benchlib.e2e_app` (plain, ``@guarded_task`` with
``lock="run"`` and ``"queue_and_run"``, celery-once, the minimal correct lock by
hand) run in interleaved rounds, and every process's CPU is read around each
batch: the publisher's (this process, while it publishes), the worker's main
process and pool processes (/proc stat), the database's (every process of the
private cluster, /proc schedstat) and Redis's. What a lock adds is each variant's
CPU per task minus the plain task's.

A second worker with ``taskguard_finished_retention=0`` serves the same guarded
task on a queue of its own: what the finished records (a late copy of a finished
task id is dropped) cost, side by side.

Every figure is the median over the rounds (a variant's CPU added per task: the
median of its difference from the plain task in the same round), which load from
other processes on the machine moves far less than a total. For experiments:
``TGBENCH_SPLIT_ROUNDS`` and ``TGBENCH_SPLIT_TASKS`` (tasks per batch) change the
run's size, ``TGBENCH_SPLIT_VARIANTS=plain,guarded,...`` measures only those.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import redis

from benchlib import cpu
from benchlib.common import (
    SCRIPTS,
    Env,
    Row,
    failed_tasks,
    mark_failed,
    not_run,
    start_worker,
    stop_worker,
)
from taskguard import schema
from tests.harness.postgres import ThrowawayCluster
from tests.harness.servers import PrivateRedis

SECTION = "7. split"
#: The private cluster's settings: durable commits as the system server's (fsync and
#: synchronous_commit on, their defaults), autovacuum off as there (its runs would
#: land in whichever batch they fall into).
PG_SETTINGS = {"shared_buffers": "128MB", "autovacuum": "off", "max_connections": "40"}
#: Variant -> (task attribute of benchlib.e2e_app, worker).
VARIANTS = {
    "plain": ("plain", "default"),
    "guarded": ("guarded", "default"),
    "guarded_no_records": ("guarded", "no_records"),
    "once": ("once", "default"),
    "minimal": ("minimal", "default"),
    "queue_and_run": ("queue_and_run", "default"),
}


def rows() -> list[Row]:
    def r(id_: str, label: str) -> Row:
        ref = None if id_ == "plain" else "split.plain"
        return Row(
            id=f"split.{id_}", section=SECTION, label=label, unit="tasks/s", ref=ref,
            ratio_kind="rate",
        )  # fmt: skip

    return [
        r("plain", "trivial task, unguarded (servers on core 0, clients on core 1)"),
        r("guarded", 'trivial task, @guarded_task(lock="run")'),
        r("guarded_no_records", "same, taskguard_finished_retention=0 (second worker)"),
        r("once", "trivial task, celery-once QueueOnce"),
        r("minimal", "trivial task, the minimal correct lock by hand in its body"),
        r("queue_and_run", 'trivial task, @guarded_task(lock="queue_and_run")'),
    ]


def _pin_tree(pid: int, core: int) -> None:
    """Pin a server and everything it has started (later children inherit it)."""
    for p in (pid, *cpu.children(pid)):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(p, {core})


@contextlib.contextmanager
def _pinned_self(core: int) -> Iterator[None]:
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _load_app(values: dict[str, str]) -> ModuleType:
    """A fresh copy of benchlib.e2e_app configured by ``values`` (the e2e section may
    have imported the module already, configured for its own servers)."""
    name = "benchlib.e2e_app_split"
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / "benchlib" / "e2e_app.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    with _environ(values):
        spec.loader.exec_module(mod)
    return mod


@dataclass
class _Worker:
    name: str
    queue: str
    proc: subprocess.Popen[bytes]
    log: Path
    main_cpu: float = 0.0
    pool_cpu: float = 0.0

    def cpu(self) -> tuple[float, dict[int, float]]:
        tree = cpu.tree_cpu_s(self.proc.pid)
        return tree.pop(self.proc.pid, 0.0), tree


def _start_worker(
    name: str, queue: str, core: int, concurrency: int, values: dict[str, str], run_id: str
) -> _Worker:
    log = Path(tempfile.gettempdir()) / f"tgbench_split_{run_id}_{name}.log"
    with open(log, "wb") as out:
        proc = start_worker(
            "e2e_app",
            f"tgsplit-{name}-{run_id}",
            concurrency,
            out,
            core=core,
            queue=queue,
            environ={**values, "TGBENCH_QUEUE": queue},
        )
    return _Worker(name, queue, proc, log)


def _stop_worker(worker: _Worker) -> None:
    stop_worker(worker.proc)
    with contextlib.suppress(OSError):
        worker.log.unlink()


#: Per-round figures of one variant, each per task (CPU in seconds).
_FIGURES = ("rate", "publisher", "main", "pool", "postgres", "redis", "waited")


@dataclass
class _Tally:
    """One variant's figures, one entry per round."""

    tasks: int = 0
    rounds: dict[str, list[float]] = field(default_factory=lambda: {f: [] for f in _FIGURES})

    def add(self, n: int, seconds: float, **cpu_s: float) -> None:
        self.tasks += n
        self.rounds["rate"].append(n / seconds)
        for name, value in cpu_s.items():
            self.rounds[name].append(value / n)
        client = (cpu_s["publisher"] + cpu_s["main"] + cpu_s["pool"]) / n
        self.rounds.setdefault("client", []).append(client)


def run(env: Env) -> list[Row]:
    out = rows()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return not_run(out, "needs 2 cores and taskset")
    server_core, client_core = cores[0], cores[1]
    rounds, per_round = env.pick((1, 60), (8, 500))
    rounds = int(os.environ.get("TGBENCH_SPLIT_ROUNDS", rounds))
    per_round = int(os.environ.get("TGBENCH_SPLIT_TASKS", per_round))
    chosen = os.environ.get("TGBENCH_SPLIT_VARIANTS", "")
    variants = [v for v in VARIANTS if not chosen or v == "plain" or v in chosen.split(",")]
    for row in out:
        if row.id.removeprefix("split.") not in variants:
            row.status = "not run: not in TGBENCH_SPLIT_VARIANTS"
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(ThrowawayCluster(PG_SETTINGS))
        postmaster = pg.postmaster()
        _pin_tree(postmaster, server_core)
        broker = stack.enter_context(PrivateRedis(server_core))
        url = pg.create_database("tgsplit")
        schema.upgrade(url)
        prefix = f"{env.redis_prefix}split:"
        values = {
            "TGBENCH_BROKER": broker.url(0),
            "TGBENCH_REDIS_URL": broker.url(1),
            "TGBENCH_DB_URL": url,
            "TGBENCH_PREFIX": prefix,
            "TGBENCH_DURABLE": "1",
            "TGBENCH_QUEUE": f"tgsplit.{env.run_id}.default",
        }
        concurrency = int(os.environ.get("TGBENCH_CONCURRENCY", 0)) or 2
        workers = {
            "default": _start_worker(
                "default", values["TGBENCH_QUEUE"], client_core, concurrency, values, env.run_id
            ),
            "no_records": _start_worker(
                "no_records", f"tgsplit.{env.run_id}.no_records", client_core, concurrency,
                {**values, "TGBENCH_FINISHED_RETENTION": "0"}, env.run_id,
            ),
        }  # fmt: skip
        for w in workers.values():
            stack.callback(_stop_worker, w)
        mod = _load_app(values)
        counter = redis.Redis.from_url(broker.url(1))
        stack.callback(counter.close)
        try:
            with _pinned_self(client_core):
                tallies = _measure(mod, workers, counter, prefix, variants, rounds, per_round,
                                   postmaster, broker, concurrency)  # fmt: skip
            failed = failed_tasks(broker.url(1), prefix)
        except Exception:
            for w in workers.values():
                with contextlib.suppress(OSError):
                    sys.stderr.write(w.log.read_text(errors="replace")[-3000:])
            raise
    _report(out, tallies, concurrency)
    for row in out:
        task = getattr(mod, VARIANTS[row.id.removeprefix("split.")][0])
        if task.name in failed:
            mark_failed([row], failed[task.name])
    return out


def _measure(
    mod: ModuleType, workers: dict[str, _Worker], counter: redis.Redis, prefix: str,
    names: list[str], rounds: int, per_round: int, postmaster: int, broker: PrivateRedis,
    concurrency: int,
) -> dict[str, _Tally]:  # fmt: skip
    assert broker.proc is not None
    done: dict[str, int] = {}
    tallies = {name: _Tally() for name in names}

    def batch(variant: str, n: int, first: int, tally: _Tally | None, timeout: float) -> None:
        attr, worker_name = VARIANTS[variant]
        task, worker = getattr(mod, attr), workers[worker_name]
        key = f"{prefix}done:{task.name}"
        done[key] = done.get(key, int(counter.get(key) or 0)) + n
        main0, pool0 = worker.cpu()
        pg0 = cpu.tree_cpu_s(postmaster, exact=True)
        redis0 = cpu.process_cpu_s(broker.proc.pid)  # type: ignore[union-attr]
        wait0 = _run_queue(worker)
        t0, pub0 = time.perf_counter(), time.process_time()
        for i in range(first, first + n):
            task.apply_async((i,), queue=worker.queue)
        pub1 = time.process_time()
        deadline = time.monotonic() + timeout
        while int(counter.get(key) or 0) < done[key]:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"worker {worker.name} exited with {worker.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{variant}: the worker did not finish {n} tasks in time")
            time.sleep(0.01)
        t1 = time.perf_counter()
        main1, pool1 = worker.cpu()
        if tally is None:
            return
        tally.add(
            n,
            t1 - t0,
            publisher=pub1 - pub0,
            main=main1 - main0,
            pool=cpu.spent(pool0, pool1),
            postgres=cpu.spent(pg0, cpu.tree_cpu_s(postmaster, exact=True)),
            redis=cpu.process_cpu_s(broker.proc.pid) - redis0,  # type: ignore[union-attr]
            waited=_run_queue(worker) - wait0,
        )

    for n, variant in enumerate(names):  # workers up, connections made, statements prepared
        batch(variant, 10 * concurrency, 9_000_000 + n * 100_000, None, timeout=120)
    for rnd in range(rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for n, variant in enumerate(order):
            batch(variant, per_round, rnd * 1_000_000 + n * per_round * 10, tallies[variant], 180)
    return tallies


def _run_queue(worker: _Worker) -> float:
    pids = [worker.proc.pid, *cpu.children(worker.proc.pid), os.getpid()]
    return sum(cpu.run_queue_s(p) for p in pids)


def _report(out: list[Row], tallies: dict[str, _Tally], concurrency: int) -> None:
    plain = tallies["plain"].rounds
    for row in out:
        t = tallies.get(row.id.removeprefix("split."))
        if t is None or not t.tasks:
            continue
        mine = t.rounds

        def med(name: str, mine: dict[str, list[float]] = mine) -> float:
            return statistics.median(mine[name]) * 1e6

        def added(name: str, mine: dict[str, list[float]] = mine) -> float:
            """Median over the rounds of this variant's figure minus the plain task's."""
            pairs = zip(mine[name], plain[name], strict=True)
            return statistics.median(a - b for a, b in pairs) * 1e6

        row.rate = statistics.median(mine["rate"])
        extra: dict[str, Any] = {
            "tasks": t.tasks,
            "rounds": len(mine["rate"]),
            "concurrency": concurrency,
            "rates_per_round": [round(x, 1) for x in mine["rate"]],
            "client_us_per_round": [round(x * 1e6) for x in mine["client"]],
            "postgres_us_per_round": [round(x * 1e6) for x in mine["postgres"]],
        }
        for name in ("publisher", "main", "pool", "client", "postgres", "redis", "waited"):
            extra[f"{name}_us"] = med(name)
            extra[f"{name}_added_us"] = added(name)
        row.extra = extra
        if row.id == "split.plain":
            row.note = (
                f"client CPU {med('client'):,.0f} us/task (publisher {med('publisher'):,.0f}, "
                f"worker main {med('main'):,.0f}, pool {med('pool'):,.0f}); "
                f"Redis {med('redis'):,.0f}; prefork -c {concurrency}"
            )
        else:
            row.note = (
                f"added per task: client CPU {added('client'):,.0f} us (publisher "
                f"{added('publisher'):,.0f}, worker main {added('main'):,.0f}, pool "
                f"{added('pool'):,.0f}), PostgreSQL {added('postgres'):,.0f} us, Redis "
                f"{added('redis'):,.0f} us"
            )
        row.note += (
            f"; medians of {len(mine['rate'])} rounds; client processes waited "
            f"{med('waited'):,.0f} us/task for a CPU"
        )
