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

A second worker with ``taskguard_prefetch_grants=False`` serves the same guarded
task on a queue of its own, so the grants the main process takes for prefetched
messages are measured against the pool processes taking their own, side by side.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
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
from chaoslib.cluster import ThrowawayCluster, free_port
from chaoslib.servers import PrivateServer

from benchlib import cpu
from benchlib.common import Env, Row, not_run
from taskguard import schema

SCRIPTS = Path(__file__).resolve().parent.parent
SECTION = "7. split"
#: The private cluster's settings: durable commits as the system server's (fsync and
#: synchronous_commit on, their defaults), autovacuum off as there (its runs would
#: land in whichever batch they fall into).
PG_SETTINGS = {"shared_buffers": "128MB", "autovacuum": "off", "max_connections": "40"}
#: Variant -> (task attribute of benchlib.e2e_app, worker).
VARIANTS = {
    "plain": ("plain", "default"),
    "guarded": ("guarded", "default"),
    "guarded_no_prefetch": ("guarded", "no_prefetch"),
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
        r("guarded_no_prefetch", "same, taskguard_prefetch_grants=False (second worker)"),
        r("once", "trivial task, celery-once QueueOnce"),
        r("minimal", "trivial task, the minimal correct lock by hand in its body"),
        r("queue_and_run", 'trivial task, @guarded_task(lock="queue_and_run")'),
    ]


class PrivateRedis(PrivateServer):
    """``redis-server`` on a free loopback port, nothing kept on disk, pinned to ``core``."""

    def __init__(self, core: int) -> None:
        self.port = free_port()
        self.core = core
        self.dir = Path(tempfile.mkdtemp(prefix="tgbench-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian package redis-server)")
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(self.core), binary, "--port", str(self.port),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def destroy(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


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
    cmd = [
        "taskset", "-c", str(core), sys.executable, "-m", "celery", "-A", "benchlib.e2e_app",
        "worker", "-P", "prefork", "-c", str(concurrency), "-l", "WARNING", "-Q", queue,
        "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-n", f"tgsplit-{name}-{run_id}@%h",
    ]  # fmt: skip
    penv = {
        **os.environ,
        **values,
        "TGBENCH_QUEUE": queue,
        "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=SCRIPTS, env=penv, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return _Worker(name, queue, proc, log)


def _stop_worker(worker: _Worker) -> None:
    proc = worker.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    with contextlib.suppress(OSError):
        worker.log.unlink()


@dataclass
class _Tally:
    """One variant's totals over its rounds."""

    tasks: int = 0
    seconds: float = 0.0
    publisher: float = 0.0
    main: float = 0.0
    pool: float = 0.0
    postgres: float = 0.0
    redis: float = 0.0
    waited: float = 0.0  # run-queue wait of the client processes (load on the client core)
    per_round: list[float] = field(default_factory=list)

    def us(self, seconds: float) -> float:
        return seconds / self.tasks * 1e6 if self.tasks else 0.0

    @property
    def client(self) -> float:
        return self.publisher + self.main + self.pool


def run(env: Env) -> list[Row]:
    out = rows()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return not_run(out, "needs 2 cores and taskset")
    server_core, client_core = cores[0], cores[1]
    rounds, per_round = env.pick((1, 60), (4, 1000))
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(ThrowawayCluster(PG_SETTINGS))
        postmaster = int((pg.data / "postmaster.pid").read_text().split()[0])
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
            "TASKGUARD_PREFETCH": "1",
            "TGBENCH_QUEUE": f"tgsplit.{env.run_id}.default",
        }
        concurrency = int(os.environ.get("TGBENCH_CONCURRENCY", 0)) or 2
        workers = {
            "default": _start_worker(
                "default", values["TGBENCH_QUEUE"], client_core, concurrency, values, env.run_id
            ),
            "no_prefetch": _start_worker(
                "no_prefetch", f"tgsplit.{env.run_id}.no_prefetch", client_core, concurrency,
                {**values, "TASKGUARD_PREFETCH": "0"}, env.run_id,
            ),
        }  # fmt: skip
        for w in workers.values():
            stack.callback(_stop_worker, w)
        mod = _load_app(values)
        counter = redis.Redis.from_url(broker.url(1))
        stack.callback(counter.close)
        try:
            with _pinned_self(client_core):
                tallies = _measure(mod, workers, counter, prefix, rounds, per_round, postmaster,
                                   broker, concurrency)  # fmt: skip
        except Exception:
            for w in workers.values():
                with contextlib.suppress(OSError):
                    sys.stderr.write(w.log.read_text(errors="replace")[-3000:])
            raise
    _report(out, tallies, concurrency)
    return out


def _measure(
    mod: ModuleType, workers: dict[str, _Worker], counter: redis.Redis, prefix: str,
    rounds: int, per_round: int, postmaster: int, broker: PrivateRedis, concurrency: int,
) -> dict[str, _Tally]:  # fmt: skip
    assert broker.proc is not None
    done: dict[str, int] = {}
    tallies = {name: _Tally() for name in VARIANTS}

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
        tally.tasks += n
        tally.seconds += t1 - t0
        tally.per_round.append(n / (t1 - t0))
        tally.publisher += pub1 - pub0
        tally.main += main1 - main0
        tally.pool += cpu.spent(pool0, pool1)
        tally.postgres += cpu.spent(pg0, cpu.tree_cpu_s(postmaster, exact=True))
        tally.redis += cpu.process_cpu_s(broker.proc.pid) - redis0  # type: ignore[union-attr]
        tally.waited += _run_queue(worker) - wait0

    names = list(VARIANTS)
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
    plain = tallies["plain"]
    for row in out:
        t = tallies[row.id.removeprefix("split.")]
        if not t.tasks:
            continue
        row.rate = t.tasks / t.seconds
        client = t.us(t.client) - plain.us(plain.client)
        extra: dict[str, Any] = {
            "tasks": t.tasks,
            "concurrency": concurrency,
            "rates_per_round": [round(x, 1) for x in t.per_round],
            "publisher_us": t.us(t.publisher),
            "worker_main_us": t.us(t.main),
            "pool_us": t.us(t.pool),
            "client_us": t.us(t.client),
            "postgres_us": t.us(t.postgres),
            "redis_us": t.us(t.redis),
            "client_run_queue_us": t.us(t.waited),
            "client_added_us": client,
            "postgres_added_us": t.us(t.postgres) - plain.us(plain.postgres),
            "redis_added_us": t.us(t.redis) - plain.us(plain.redis),
        }
        row.extra = extra
        if row.id == "split.plain":
            row.note = (
                f"client CPU {t.us(t.client):,.0f} us/task (publisher {t.us(t.publisher):,.0f}, "
                f"worker main {t.us(t.main):,.0f}, pool {t.us(t.pool):,.0f}); "
                f"Redis {t.us(t.redis):,.0f}; prefork -c {concurrency}"
            )
        else:
            row.note = (
                f"added per task: client CPU {client:,.0f} us (publisher "
                f"{t.us(t.publisher) - plain.us(plain.publisher):,.0f}, worker main "
                f"{t.us(t.main) - plain.us(plain.main):,.0f}, pool "
                f"{t.us(t.pool) - plain.us(plain.pool):,.0f}), PostgreSQL "
                f"{extra['postgres_added_us']:,.0f} us, Redis {extra['redis_added_us']:,.0f} us"
            )
        row.note += f"; client processes waited {t.us(t.waited):,.0f} us/task for a CPU"
