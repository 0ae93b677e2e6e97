"""Section 5: the cookbook's workload, measured -- a duplicate storm on a feed importer.

The Celery docs' "ensuring a task is only executed one at a time" recipe guards a
feed importer with ``cache.add`` on memcached. Here that importer takes a storm:
5,000 submissions for 50 feeds (100 each, in one seeded random order, published
as fast as one client can), each run 20 ms of work (a sleep: a feed fetch waits,
it does not compute), through one real ``celery worker -P prefork -c 4`` on
RabbitMQ. One storm per lock, one after the other, on the same worker.

Per variant: the wall time from the first submission until the worker has
finished the last message that was published; the runs executed; submissions
refused at ``.delay()`` (queue-phase locks; for ``coalesce``, submissions merged
into the feed's pending run); duplicates that reached the worker only to be
skipped (a deferred pending run is counted once, when it ends); and the most runs of one feed at once, computed afterwards
from every run's recorded start and end times (taskguard.demo.record).

The overrun case: runs of 1.5 s under a 1 s lock (the recipe's expiry, taskguard's
ttl), with duplicates submitted every 0.25 s while they run.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from benchlib.common import Env, Row, scratch_db, start_worker, stop_worker, wait_count
from taskguard.demo.record import max_concurrency
from tests.harness.servers import PrivateMemcached

SECTION = "5. storm"
CONCURRENCY = 4
#: A Redis database no test uses (tests use 0 and 1, the other sections 11).
REDIS_DB = int(os.environ.get("TGBENCH_STORM_REDIS_DB", "12"))

#: (row id suffix, storm_app task attribute, label)
STORM = (
    ("plain", "plain", "storm: unguarded"),
    ("recipe", "recipe", "storm: cookbook recipe (Django cache.add on memcached)"),
    ("once", "once", "storm: celery-once QueueOnce"),
    ("singleton", "singleton", "storm: celery-singleton Singleton"),
    ("run", "run", 'storm: @guarded_task(lock="run")'),
    ("queue_and_run", "queue_and_run", 'storm: @guarded_task(lock="queue_and_run")'),
    ("coalesce", "coalesce", 'storm: @guarded_task(on_conflict="coalesce")'),
)
OVERRUN = (
    ("overrun_recipe", "recipe_long", "overrun: cookbook recipe, 1 s expiry, 1.5 s runs"),
    ("overrun_run", "run_long", 'overrun: @guarded_task(lock="run"), 1 s ttl, 1.5 s runs'),
)


def rows() -> list[Row]:
    def r(id_: str, label: str, ref: str | None) -> Row:
        return Row(
            id=f"storm.{id_}",
            section=SECTION,
            label=label,
            unit="subm/s",
            ref=ref,
            ratio_kind="rate",
        )

    out = [r(id_, label, None if id_ == "plain" else "storm.plain") for id_, _, label in STORM]
    out += [r(id_, label, None) for id_, _, label in OVERRUN]
    return out


# -- sizes ------------------------------------------------------------------------------


def storm_plan(env: Env) -> list[str]:
    """Feed URLs in submission order: every feed the same number of times, shuffled."""
    feeds, per_feed = env.pick((6, 10), (50, 100))
    plan = [f"https://feeds.example/{i}.xml" for i in range(feeds)] * per_feed
    random.Random(18).shuffle(plan)
    return plan


def overrun_plan(env: Env) -> tuple[list[str], float, int]:
    """(feeds, seconds between submissions of each feed, submissions per feed)."""
    feeds, gap, per_feed = env.pick((1, 1.2, 2), (2, 0.25, 24))
    return [f"https://slow.example/{i}.xml" for i in range(feeds)], gap, per_feed


# -- one storm ------------------------------------------------------------------------------


def _published(result: Any, task_id: str) -> bool:
    """Whether ``.apply_async`` sent a message (queue-phase locks refuse duplicates by
    returning None, an EagerResult, or the holder's result instead)."""
    from celery.result import EagerResult

    return result is not None and not isinstance(result, EagerResult) and result.id == task_id


def _submit(task: Any, feed: str) -> bool:
    from celery.utils import uuid

    task_id = uuid()
    return _published(task.apply_async((feed,), task_id=task_id), task_id)


def overlapping_runs(spans: Sequence[tuple[float, float]]) -> int:
    """How many of one feed's runs overlapped another run of the same feed."""
    ordered = sorted(spans)
    marked: set[int] = set()
    latest = -1  # index of the run, among those started so far, that ends last
    for i, (start, end) in enumerate(ordered):
        if latest >= 0 and start < ordered[latest][1]:
            marked.update((i, latest))
        if latest < 0 or end > ordered[latest][1]:
            latest = i
    return len(marked)


def _outcome(
    r: redis.Redis, app: Any, task: Any, submissions: int, published: int, t0: float, t1: float
) -> dict[str, Any]:
    by_feed: dict[str, list[tuple[float, float]]] = {}
    for raw in r.lrange(app.runs_key(task.name), 0, -1):
        feed, start, end = raw.decode().split()
        by_feed.setdefault(feed, []).append((float(start), float(end)))
    runs = sum(len(v) for v in by_feed.values())
    return {
        "submissions": submissions,
        "refused_at_submit": submissions - published,
        "reached_worker": published,
        "runs": runs,
        "skipped_at_worker": published - runs,
        "max_at_once": max((max_concurrency(v) for v in by_feed.values()), default=0),
        "overlapping_runs": sum(overlapping_runs(v) for v in by_feed.values()),
        "feeds_run": len(by_feed),
        "wall_s": round(t1 - t0, 3),
    }


def _storm(
    r: redis.Redis, app: Any, task: Any, plan: Sequence[str], proc: subprocess.Popen[bytes]
) -> dict[str, Any]:
    t0 = time.monotonic()
    published = sum(_submit(task, feed) for feed in plan)
    submitted = time.monotonic()
    timeout = max(60.0, 10 * len(plan) * app.WORK / CONCURRENCY)
    t1 = wait_count(r, app.done_key(task.name), published, timeout, proc)
    out = _outcome(r, app, task, len(plan), published, t0, t1)
    out["submit_s"] = round(submitted - t0, 3)
    return out


def _overrun(
    r: redis.Redis, app: Any, tasks: Sequence[Any], env: Env, proc: subprocess.Popen[bytes]
) -> dict[str, dict[str, Any]]:
    """Submit each slow feed to each task every ``gap`` seconds; wait until all drained."""
    feeds, gap, per_feed = overrun_plan(env)
    t0 = time.monotonic()
    published = dict.fromkeys([t.name for t in tasks], 0)
    for k in range(per_feed):
        if k:
            time.sleep(max(0.0, t0 + k * gap - time.monotonic()))
        for task in tasks:
            published[task.name] += sum(_submit(task, feed) for feed in feeds)
    submitted = time.monotonic()
    timeout = 60.0 + per_feed * len(feeds) * len(tasks) * app.LONG_WORK
    out = {}
    for task in tasks:
        t1 = wait_count(r, app.done_key(task.name), published[task.name], timeout, proc)
        o = _outcome(r, app, task, per_feed * len(feeds), published[task.name], t0, t1)
        o["submit_s"] = round(submitted - t0, 3)
        out[task.name] = o
    return out


def _warm_up(r: redis.Redis, app: Any, proc: subprocess.Popen[bytes]) -> None:
    """Worker up, every pool process connected to PostgreSQL, memcached and Redis;
    then forget the warm-up's counters and runs."""
    tasks = [getattr(app, attr) for _, attr, _ in STORM]
    published = {
        t.name: sum(_submit(t, f"https://warm.example/{i}.xml") for i in range(2 * CONCURRENCY))
        for t in tasks
    }
    for task in tasks:
        wait_count(r, app.done_key(task.name), published[task.name], 120, proc)
        r.delete(app.done_key(task.name), app.runs_key(task.name))


def _note(o: dict[str, Any]) -> str:
    return (
        f"{o['wall_s']:.1f} s to drain ({o['submit_s']:.1f} s submitting); "
        f"{o['runs']:,} runs; {o['refused_at_submit']:,} refused at submit; "
        f"{o['skipped_at_worker']:,} skipped at the worker; "
        f"max {o['max_at_once']} runs of one feed at once"
    )


@contextlib.contextmanager
def _quiet_taskguard_log() -> Iterator[None]:
    # lock="queue_and_run" logs every refused submission (thousands) in the publisher;
    # the records are still made, they just are not printed over the report.
    logger = logging.getLogger("taskguard")
    handler = logging.NullHandler()
    logger.addHandler(handler)
    saved = logger.propagate
    logger.propagate = False
    try:
        yield
    finally:
        logger.propagate = saved
        logger.removeHandler(handler)


def storm_redis_url(env: Env) -> str:
    parts = urlsplit(env.redis_url)
    return urlunsplit(parts._replace(path=f"/{REDIS_DB}"))


def run(env: Env) -> list[Row]:
    out = rows()
    by_id = {r.id: r for r in out}
    prefix = f"{env.redis_prefix}storm:"
    redis_url = storm_redis_url(env)
    r = redis.Redis.from_url(redis_url)
    with PrivateMemcached() as mc, scratch_db(env, "storm") as db_url:
        os.environ.update(
            TGBENCH_BROKER=env.amqp_url,
            TGBENCH_STORM_QUEUE=f"tgbench.storm.{env.run_id}",
            TGBENCH_STORM_DB_URL=db_url,
            TGBENCH_STORM_REDIS_URL=redis_url,
            TGBENCH_STORM_MEMCACHED=mc.address,
            TGBENCH_STORM_PREFIX=prefix,
        )
        app = importlib.import_module("benchlib.storm_app")
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tgbench_storm_{env.run_id}.log"
        with open(log_path, "wb") as log:
            proc = start_worker("storm_app", f"tgbench-storm-{env.run_id}", CONCURRENCY, log)
        try:
            with _quiet_taskguard_log():
                _warm_up(r, app, proc)
                _measure(env, r, app, proc, by_id)
        except Exception:
            with contextlib.suppress(OSError):
                sys.stderr.write(log_path.read_text(errors="replace")[-3000:])
            raise
        finally:
            stop_worker(proc)
            with contextlib.suppress(Exception), app.app.connection_for_write() as conn:
                conn.default_channel.queue_delete(f"tgbench.storm.{env.run_id}")
            with contextlib.suppress(Exception):
                for pattern in (f"{prefix}*", f"qo_{prefix}*"):
                    for key in r.scan_iter(match=pattern, count=1000):
                        r.delete(key)
            r.close()
            with contextlib.suppress(OSError):
                log_path.unlink()
    return out


def _measure(
    env: Env, r: redis.Redis, app: Any, proc: subprocess.Popen[bytes], by_id: dict[str, Row]
) -> None:
    plan = storm_plan(env)
    feeds = len(set(plan))
    for id_, attr, _ in STORM:
        row = by_id[f"storm.{id_}"]
        o = _storm(r, app, getattr(app, attr), plan, proc)
        row.rate = o["submissions"] / o["wall_s"]
        row.extra = {**o, "feeds": feeds, "work_s": app.WORK, "concurrency": CONCURRENCY}
        row.note = _note(o)
    slow, gap, per_feed = overrun_plan(env)
    tasks = {id_: getattr(app, attr) for id_, attr, _ in OVERRUN}
    # A quick run's single slow feed leaves the -c 4 pool room for both variants at once
    # (at most 2 + 1 runs); a full run's two feeds do not, so it runs them in turn.
    groups = [list(tasks)] if env.quick else [[id_] for id_ in tasks]
    for group in groups:
        outcomes = _overrun(r, app, [tasks[id_] for id_ in group], env, proc)
        for id_ in group:
            o = outcomes[tasks[id_].name]
            row = by_id[f"storm.{id_}"]
            row.rate = o["submissions"] / o["wall_s"]
            row.extra = {
                **o,
                "feeds": len(slow),
                "gap_s": gap,
                "submissions_per_feed": per_feed,
                "work_s": app.LONG_WORK,
                "expiry_s": app.LONG_EXPIRE,
                "concurrency": CONCURRENCY,
                "alongside": [x for x in group if x != id_],
            }
            row.note = _note(o) + f"; {o['overlapping_runs']} runs overlapped another"
