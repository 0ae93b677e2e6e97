"""Section 4: end-to-end task throughput through a real prefork worker on RabbitMQ.

One worker (``celery worker -P prefork -c <cores>``) on a queue of its own serves
the unguarded, guarded (``lock="run"`` and ``"queue_and_run"``), celery-once and
minimal-lock-by-hand variants; batches alternate between
variants round by round. A batch's time runs from its first publish until the
worker has finished its last task. A second worker, configured with
``taskguard_durable=False``, repeats the unguarded, guarded and celery-once variants:
neither lock then waits for a disk flush (celery-once's Redis keeps nothing on disk
here), which separates what durability costs from what the rest costs.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import redis

from benchlib.common import (
    Env,
    Row,
    failed_tasks,
    mark_failed,
    scratch_db,
    start_worker,
    stop_worker,
    wait_count,
)


def rows() -> list[Row]:
    def r(id_: str, label: str, ref: str | None) -> Row:
        return Row(
            id=f"e2e.{id_}",
            section="4. end to end",
            label=label,
            unit="tasks/s",
            ref=ref,
            ratio_kind="rate",
        )

    return [
        r("plain", "trivial task, unguarded", None),
        r("guarded", 'trivial task, @guarded_task(lock="run")', "e2e.plain"),
        r("once", "trivial task, celery-once QueueOnce", "e2e.plain"),
        r("minimal", "trivial task, the minimal correct lock by hand in its body", "e2e.plain"),
        r("queue_and_run", 'trivial task, @guarded_task(lock="queue_and_run")', "e2e.plain"),
        r("guarded_relaxed", "trivial task, @guarded_task, taskguard_durable=False", None),
        r("once_relaxed", "trivial task, celery-once QueueOnce, in the same worker", None),
    ]


def _concurrency() -> int:
    """Pool processes of the benchmark worker: the cores, or $TGBENCH_CONCURRENCY."""
    return int(os.environ.get("TGBENCH_CONCURRENCY", 0)) or os.cpu_count() or 2


def _phase(
    env: Env, mod: Any, names: list[str], durable: bool, rounds: int, per_round: int
) -> dict[str, float]:
    """Start one worker, run ``rounds`` batches of ``per_round`` tasks per variant
    (alternating), stop the worker; returns tasks/s per variant."""
    tasks = {name: getattr(mod, name) for name in names}
    concurrency = _concurrency()
    r = redis.Redis.from_url(env.redis_url)
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tgbench_worker_{env.run_id}.log"
    os.environ["TGBENCH_DURABLE"] = "1" if durable else "0"
    with open(log_path, "wb") as log:
        proc = start_worker("e2e_app", f"tgbench-{env.run_id}", concurrency, log)
    try:
        counts = {
            name: int(r.get(f"{env.redis_prefix}done:{t.name}") or 0) for name, t in tasks.items()
        }

        def batch(name: str, n: int, base: int, timeout: float) -> float:
            task = tasks[name]
            t0 = time.monotonic()
            for i in range(base, base + n):
                task.delay(i)
            counts[name] += n
            return (
                wait_count(r, f"{env.redis_prefix}done:{task.name}", counts[name], timeout, proc)
                - t0
            )

        offset = 0 if durable else 50_000_000  # distinct lock keys in each phase
        for name in tasks:  # worker up, each pool process connected, statements prepared
            batch(name, 4 * concurrency, offset + 10_000_000, timeout=90)
        seconds = dict.fromkeys(tasks, 0.0)
        for rnd in range(rounds):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                seconds[name] += batch(name, per_round, offset + rnd * per_round, timeout=120)
        return {name: rounds * per_round / seconds[name] for name in tasks}
    except Exception:
        with contextlib.suppress(OSError):
            sys.stderr.write(log_path.read_text(errors="replace")[-3000:])
        raise
    finally:
        stop_worker(proc)
        with contextlib.suppress(Exception):
            for k in r.scan_iter(match=f"qo_{env.redis_prefix}*"):
                r.delete(k)
        r.close()
        with contextlib.suppress(OSError):
            log_path.unlink()


def run(env: Env) -> list[Row]:
    out = rows()
    by_id = {r.id: r for r in out}
    with scratch_db(env, "e2e") as url:
        os.environ.update(
            TGBENCH_BROKER=env.amqp_url,
            TGBENCH_QUEUE=f"tgbench.{env.run_id}",
            TGBENCH_DB_URL=url,
            TGBENCH_REDIS_URL=env.redis_url,
            TGBENCH_PREFIX=env.redis_prefix,
        )
        mod = importlib.import_module("benchlib.e2e_app")
        try:
            _measure(env, mod, by_id)
        finally:
            # Only now: the publisher remembers the queue as declared for the whole run.
            with contextlib.suppress(Exception), mod.app.connection_for_write() as conn:
                conn.default_channel.queue_delete(f"tgbench.{env.run_id}")
    return out


def _measure(env: Env, mod: Any, by_id: dict[str, Row]) -> None:
    rounds, per_round = env.pick((1, 100), (4, 500))  # 2,000 tasks per variant in a full run
    concurrency = _concurrency()
    names = ["plain", "once", "minimal"]
    if mod.GUARDED_UNAVAILABLE:
        for row_id in (
            "e2e.guarded",
            "e2e.queue_and_run",
            "e2e.guarded_relaxed",
            "e2e.once_relaxed",
        ):
            by_id[row_id].status = f"not run: {mod.GUARDED_UNAVAILABLE}"
    else:
        names.insert(1, "guarded")
        names.append("queue_and_run")
    rates = _phase(env, mod, names, True, rounds, per_round)
    for name, rate in rates.items():
        row = by_id[f"e2e.{name}"]
        row.rate = rate
        row.extra = {"tasks": rounds * per_round, "rounds": rounds, "concurrency": concurrency}
        row.note = f"{rounds * per_round:,} tasks, prefork -c {concurrency}, first publish to last task done"
    if mod.STUB:  # a diagnosis, not a measurement of the library: say so on its rows
        unsent = {
            "release": "releases",
            "adopt": "adoptions of handed-over leases",
        }[mod.STUB]
        stubbed = ["e2e.queue_and_run"]
        if mod.STUB != "adopt":
            stubbed += ["e2e.guarded", "e2e.guarded_relaxed"]
        for row_id in stubbed:
            by_id[row_id].note += f"; TGBENCH_STUB={mod.STUB}: the worker's {unsent} not sent"
    if "guarded" in names:
        relaxed = _phase(env, mod, ["plain", "guarded", "once"], False, rounds, per_round)
        for name in ("guarded", "once"):
            row = by_id[f"e2e.{name}_relaxed"]
            row.rate = relaxed[name]
            row.ratio = relaxed[name] / relaxed["plain"]
            row.extra = {"tasks": rounds * per_round, "plain_same_worker": relaxed["plain"]}
            row.note = (
                f"second worker with taskguard_durable=False; ratio vs the unguarded task "
                f"in that worker ({relaxed['plain']:,.0f} tasks/s)"
            )
    failed = failed_tasks(env.redis_url, env.redis_prefix)
    for row_id, row in by_id.items():
        task = getattr(mod, row_id.removeprefix("e2e.").removesuffix("_relaxed"), None)
        if task is not None and task.name in failed:
            mark_failed([row], failed[task.name])
