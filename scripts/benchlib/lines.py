"""Section 8: Python lines executed per run and per publish (deterministic; issue 34).

A worker (``celery worker -P prefork -c 1``, RabbitMQ, PostgreSQL) runs delivered
messages of four trivial tasks: ``plain``; ``minimal``, the minimal correct lock by
hand in its body (a prepared ``INSERT … ON CONFLICT … DO UPDATE … WHERE expired``
upsert and an owner-checked ``DELETE``, psycopg, autocommit: :class:`benchlib.pairs.
MinimalLock`); ``guarded``, ``@guarded_task(lock="run")`` with its defaults; and
``queue_and_run``, whose run adopts the lease its publish took. In the
pool process each task's tracer (the function Celery's ``build_tracer`` made, which the
pool calls per message) is wrapped to count ``sys.settrace`` 'line' events in that
thread, by the file they run in (taskguard, stdlib, psycopg, sqlalchemy, celery and
kombu, other). Each variant: 50 warm-up runs, then the mean of 100. Publishing is
counted the same way in this process: ``apply_async`` of the plain task, of a
``lock="run"`` task and of a ``lock="queue_and_run"`` task (distinct keys).

Dramatiq (taskguard.dramatiq, issue 43), in this process: three actors on a stub
broker with Dramatiq's default middleware and ``TaskGuardMiddleware``, the same three
bodies (plain, the minimal lock by hand, ``key=`` with its defaults); each message
processed as a Dramatiq worker thread does (``before_process_message``, the actor,
``after_process_message``, or ``after_skip_message``), on the same database.

The figures are what is compared, not times: the same code gives the same count on
a loaded machine. A task that raised in the worker fails the run rows, with its
error. The worker side is its own module: ``celery -A benchlib.lines``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from benchlib import lines_taskiq
from benchlib.common import (
    Env,
    Row,
    failed_tasks,
    mark_failed,
    scratch_db,
    start_worker,
    stop_worker,
)

SCRIPTS = Path(__file__).resolve().parent.parent
WARM, RUNS = 50, 100
KINDS = ("plain", "minimal", "guarded", "queue_and_run")
PUBLISHED = ("plain", "guarded", "queue_and_run")
_STDLIB = sysconfig.get_paths()["stdlib"]
#: TGLINES_OTEL=api: taskguard.otel.instrument() with no tracer provider set (the API's
#: no-op tracer); TGLINES_OTEL=sdk: with the SDK's provider recording every span (issue 44).
OTEL = os.environ.get("TGLINES_OTEL", "")
#: TGLINES_DETAIL=1: count by function too, and print the largest differences (diagnosis;
#: TGLINES_TOP of them, default 60).
DETAIL = os.environ.get("TGLINES_DETAIL") == "1"
TOP = int(os.environ.get("TGLINES_TOP", "60"))


def rows() -> list[Row]:
    def r(id_: str, label: str, ref: str | None = None) -> Row:
        return Row(
            id=f"lines.{id_}", section="8. lines per run", label=label, unit="lines", ref=ref
        )

    return [
        r("plain", "a plain task's run (worker pool process, delivered message)"),
        r("minimal", "lines the minimal correct lock by hand adds to a run"),
        r("guarded", 'lines @guarded_task(lock="run") adds to a run'),
        r("ratio", "guarded / minimal (added lines; issue 34 target <= 1.5)"),
        r("queue_and_run", 'lines a lock="queue_and_run" task adds to a run (adopting its lease)'),
        r("dramatiq_plain", "Dramatiq: a plain actor's run (hooks and actor, in process)"),
        r("dramatiq_minimal", "Dramatiq: lines the minimal correct lock by hand adds"),
        r("dramatiq_guarded", "Dramatiq: lines an actor with key=, ttl=60 adds to a run"),
        r("dramatiq_ratio", "Dramatiq: guarded / minimal (added lines; target <= 1.5)"),
        r("publish_plain", "apply_async of a plain task"),
        r("publish_run", 'lines apply_async of a lock="run" task adds (target <= 60)'),
        r("publish_queue_and_run", 'lines apply_async of a lock="queue_and_run" task adds'),
        *lines_taskiq.rows(),
    ]


def _where(filename: str) -> str:
    for part, name in (
        ("/taskguard/", "taskguard"),
        ("/psycopg", "psycopg"),
        ("/sqlalchemy/", "sqlalchemy"),
        ("/celery/", "celery"),
        ("/kombu/", "celery"),
        ("/billiard/", "celery"),
        ("/vine/", "celery"),
        ("/amqp/", "celery"),
    ):
        if part in filename:
            return name
    if filename.startswith(_STDLIB) and "site-packages" not in filename:
        return "stdlib"
    return "other"


def counting(call: Callable[..., Any]) -> Callable[..., tuple[Any, Counter[str]]]:
    """``call`` wrapped to return (its result, the 'line' events it ran, by file kind)."""

    def counted(*args: Any, **kwargs: Any) -> tuple[Any, Counter[str]]:
        seen: Counter[str] = Counter()
        kinds: dict[str, str] = {}

        def local(frame: FrameType, event: str, _arg: Any) -> Any:
            if event == "line":
                name = frame.f_code.co_filename
                kind = kinds.get(name)
                if kind is None:
                    kind = kinds[name] = _where(name)
                seen[kind] += 1
                if DETAIL:
                    seen[f"{kind} {name.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1
            return local

        def tracer(frame: FrameType, event: str, _arg: Any) -> Any:
            return local

        sys.settrace(tracer)
        try:
            result = call(*args, **kwargs)
        finally:
            sys.settrace(None)
        return result, seen

    return counted


# -- the worker side (celery -A benchlib.lines worker) ---------------------------------------


def build_app() -> Any:
    """The Celery app of this section, configured from the environment."""
    from celery import Celery
    from celery.signals import worker_process_init

    from taskguard import guarded_task

    prefix = os.environ["TGLINES_PREFIX"]
    db_url = os.environ["TGLINES_DB_URL"]
    if OTEL:
        _instrument(OTEL)
    app = Celery("tglines", broker=os.environ["TGLINES_BROKER"])
    app.conf.update(
        task_default_queue=os.environ["TGLINES_PUBLISH_QUEUE"],
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        taskguard_database_url=db_url,
    )
    by_hand: list[Any] = []

    @app.task(name=f"{prefix}plain")
    def plain(i: int) -> None:
        return None

    @app.task(name=f"{prefix}minimal")
    def minimal(i: int) -> None:
        if not by_hand:  # connected in the pool process, after the fork
            from benchlib.pairs import MinimalLock

            by_hand.append(MinimalLock(Row("lines.minimal", "", ""), db_url))
        by_hand[0].pair(f"{prefix}m:{i}")

    @guarded_task(app=app, key=prefix + "k:{i}", ttl=60, lock="run", name=f"{prefix}guarded")
    def guarded(i: int) -> None:
        return None

    @guarded_task(
        app=app, key=prefix + "q:{i}", ttl=60, lock="queue_and_run", name=f"{prefix}queue_and_run"
    )
    def queue_and_run(i: int) -> None:
        return None

    @worker_process_init.connect(weak=False)
    def _count_runs(**_: Any) -> None:
        import redis

        results = redis.Redis.from_url(os.environ["TGLINES_REDIS_URL"])
        for kind in KINDS:
            task = app.tasks[f"{prefix}{kind}"]
            traced = counting(task.__trace__)

            def run(*args: Any, _traced: Any = traced, _kind: str = kind, **kw: Any) -> Any:
                result, seen = _traced(*args, **kw)
                info = getattr(result, "info", None)  # celery's trace_ok_t
                if info is not None and info.state == "FAILURE":
                    error = f"{type(info.retval).__name__}: {info.retval}"
                    results.hsetnx(f"{prefix}failed", f"{prefix}{_kind}", error)
                results.rpush(f"{prefix}lines:{_kind}", json.dumps(seen))
                return result

            task.__trace__ = run

    tasks = (plain, minimal, guarded, queue_and_run)
    app.lines_tasks = dict(zip(KINDS, tasks, strict=True))  # type: ignore[attr-defined]
    return app


def _instrument(how: str) -> None:
    from taskguard import otel

    provider = None
    if how == "sdk":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    elif how != "api":
        raise SystemExit(f"TGLINES_OTEL must be api or sdk, not {how!r}")
    otel.instrument(tracer_provider=provider)


app = build_app() if os.environ.get("TGLINES_DB_URL") else None


# -- the measuring side -----------------------------------------------------------------------


def _mean(samples: list[Counter[str]]) -> tuple[float, dict[str, float]]:
    total: Counter[str] = Counter()
    for s in samples:
        total.update(s)
    by = {k: v / len(samples) for k, v in sorted(total.items())}
    return sum(v for k, v in by.items() if " " not in k), by


def _split(by: dict[str, float], ref: dict[str, float]) -> str:
    keys = sorted(k for k in set(by) | set(ref) if " " not in k)
    text = ", ".join(f"{k} {by.get(k, 0) - ref.get(k, 0):+.0f}" for k in keys)
    if DETAIL:
        diff = {k: by.get(k, 0) - ref.get(k, 0) for k in set(by) | set(ref) if " " in k}
        top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:TOP]
        text += "".join(f"\n    {v:+6.0f} {k}" for k, v in top if round(v))
    return text


def run(env: Env) -> list[Row]:
    import redis

    out = rows()
    by_id = {r.id: r for r in out}
    run_queue = f"tglines.{env.run_id}"
    with scratch_db(env, "lines") as url:
        os.environ.update(
            TGLINES_BROKER=env.amqp_url,
            TGLINES_PUBLISH_QUEUE=f"tglines.{env.run_id}.published",
            TGLINES_DB_URL=url,
            TGLINES_REDIS_URL=env.redis_url,
            TGLINES_PREFIX=f"{env.redis_prefix}lines:",
        )
        the_app = build_app()
        prefix = os.environ["TGLINES_PREFIX"]
        r = redis.Redis.from_url(env.redis_url)
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tglines_worker_{env.run_id}.log"
        with open(log_path, "wb") as log:
            proc = start_worker("lines", f"tglines-{env.run_id}", 1, log, queue=run_queue)
        try:
            runs: dict[str, tuple[float, dict[str, float]]] = {}
            for kind in KINDS:
                task = the_app.lines_tasks[kind]
                for i in range(WARM + RUNS):
                    task.apply_async((i,), queue=run_queue)
                key = f"{prefix}lines:{kind}"
                deadline = time.monotonic() + 180
                while r.llen(key) < WARM + RUNS:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the worker ran {r.llen(key)} {kind} tasks of 150")
                    time.sleep(0.05)
                samples = [Counter(json.loads(x)) for x in r.lrange(key, WARM, -1)]
                runs[kind] = _mean(samples)
            failed = failed_tasks(env.redis_url, prefix)
            published = _publish(the_app)
            lines_taskiq.fill(out, lines_taskiq.measure(url))
            dramatiq_runs = _dramatiq(url, prefix)
        except Exception:
            with contextlib.suppress(OSError):
                sys.stderr.write(log_path.read_text(errors="replace")[-3000:])
            raise
        finally:
            stop_worker(proc)
            with contextlib.suppress(Exception), the_app.connection_for_write() as conn:
                for q in (run_queue, os.environ["TGLINES_PUBLISH_QUEUE"]):
                    conn.default_channel.queue_delete(q)
            r.close()
            with contextlib.suppress(OSError):
                log_path.unlink()
    plain_total, plain_by = runs["plain"]
    by_id["lines.plain"].rate = plain_total
    by_id["lines.plain"].note = "by file: " + ", ".join(
        f"{k} {v:.0f}" for k, v in plain_by.items() if " " not in k
    )
    added = {}
    for kind in KINDS[1:]:
        total, by = runs[kind]
        added[kind] = total - plain_total
        row = by_id[f"lines.{kind}"]
        row.rate = added[kind]
        row.note = "added, by file: " + _split(by, plain_by)
        row.extra = {"total": total, "by_file": by}
    ratio = by_id["lines.ratio"]
    ratio.rate = added["guarded"] / added["minimal"]
    ratio.unit = "x"
    why = "; ".join(f"{k} task: {failed[prefix + k]}" for k in KINDS if prefix + k in failed)
    if why:  # every run row is measured against the others
        mark_failed([by_id[f"lines.{k}"] for k in (*KINDS, "ratio")], why)
    d_plain, d_plain_by = dramatiq_runs["plain"]
    by_id["lines.dramatiq_plain"].rate = d_plain
    for kind in ("minimal", "guarded"):
        total, by = dramatiq_runs[kind]
        row = by_id[f"lines.dramatiq_{kind}"]
        row.rate = total - d_plain
        row.note = "added, by file: " + _split(by, d_plain_by)
    d_ratio = by_id["lines.dramatiq_ratio"]
    d_ratio.rate = by_id["lines.dramatiq_guarded"].rate / by_id["lines.dramatiq_minimal"].rate
    d_ratio.unit = "x"
    pub_plain, pub_plain_by = published["plain"]
    by_id["lines.publish_plain"].rate = pub_plain
    for kind, row_id in (("guarded", "publish_run"), ("queue_and_run", "publish_queue_and_run")):
        total, by = published[kind]
        row = by_id[f"lines.{row_id}"]
        row.rate = total - pub_plain
        row.note = "added, by file: " + _split(by, pub_plain_by)
    return out


def _publish(the_app: Any) -> dict[str, tuple[float, dict[str, float]]]:
    """Lines of ``apply_async`` per task kind (mean of RUNS after WARM), in this process."""
    out = {}
    for kind in PUBLISHED:
        send = counting(the_app.lines_tasks[kind].apply_async)
        samples = [send((1_000_000 + i,))[1] for i in range(WARM + RUNS)][WARM:]
        out[kind] = _mean(samples)
    return out


def _dramatiq(url: str, prefix: str) -> dict[str, tuple[float, dict[str, float]]]:
    """Lines per processed message of each Dramatiq actor (mean of RUNS after WARM)."""
    import dramatiq
    from dramatiq.broker import MessageProxy
    from dramatiq.brokers.stub import StubBroker
    from dramatiq.middleware import SkipMessage

    from benchlib.pairs import MinimalLock
    from taskguard.dramatiq import TaskGuardMiddleware

    broker = StubBroker()
    broker.add_middleware(TaskGuardMiddleware(url))
    by_hand = MinimalLock(Row("lines.dramatiq_minimal", "", ""), url)

    def minimal_body(i: int) -> None:
        by_hand.pair(f"{prefix}dm:{i}")

    actors = {
        "plain": dramatiq.actor(lambda i: None, broker=broker, actor_name=f"{prefix}d_plain"),
        "minimal": dramatiq.actor(minimal_body, broker=broker, actor_name=f"{prefix}d_min"),
        "guarded": dramatiq.actor(
            lambda i: None,
            broker=broker,
            actor_name=f"{prefix}d_guarded",
            key=prefix + "dk:{i}",
            ttl=60,
        ),
    }

    def process(actor: Any, i: int) -> None:  # as dramatiq.worker's process_message
        message = MessageProxy(actor.message(i))
        try:
            broker.emit_before("process_message", message)
            result = actor(*message.args, **message.kwargs)
            broker.emit_after("process_message", message, result=result)
        except SkipMessage:
            broker.emit_after("skip_message", message)

    out = {}
    try:
        for kind, actor in actors.items():
            counted = counting(process)
            samples = [counted(actor, i)[1] for i in range(WARM + RUNS)][WARM:]
            out[kind] = _mean(samples)
    finally:
        by_hand.close()
        broker.close()
    return out


def report_lines(rows_: list[Row]) -> str:
    """The section's figures as text (for a commit message or a note)."""
    return "\n".join(
        f"{r.label}: {r.rate:.1f} {r.unit}  {r.note}" for r in rows_ if r.rate is not None
    )


if __name__ == "__main__":  # cd scripts && python -m benchlib.lines: this section alone
    from benchlib import common

    e = common.Env(
        pg_url=os.environ.get(
            "TASKGUARD_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        ),
        redis_url=os.environ.get("TASKGUARD_BENCH_REDIS_URL", "redis://127.0.0.1:6379/11"),
        amqp_url=os.environ.get("TASKGUARD_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"),
        quick=False,
    )
    try:
        print(report_lines(run(e)))
    finally:
        common.drop_leftovers(e)
        common.redis_cleanup(e)
