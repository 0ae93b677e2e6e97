"""The Celery glue's seams: options declared once, bounded task ids, finished-task
records, stop_on_lease_loss in a thread and in the main thread, the dropped-copy
metric. (Import circles: tests/unit/test_layering.py.) Real PostgreSQL where a
database is used."""

from __future__ import annotations

import inspect
import threading
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from taskguard import GuardedTask, LeaseLost, TaskGuard, guarded_task, signals
from taskguard.celery import task
from taskguard.celery.message import MAX_STORED_ID, is_shortened, stored_task_id
from taskguard.celery.options import ATTR_PREFIX, OPTION_NAMES, option_defaults
from taskguard.celery.running import Run
from taskguard.companions import FINISHED_PREFIX
from taskguard.config import reset_guards
from taskguard.held_lease import Interrupter
from taskguard.lease import Holder, Marker
from taskguard.runs import finished_key, finished_retention
from taskguard.validation import normalize_key

PACKAGE = Path(__file__).resolve().parents[2] / "taskguard"


def test_the_decorator_overload_names_every_option_once() -> None:
    # The typed overload is for type checkers; it must list exactly the dataclass fields.
    overloads = typing.get_overloads(task.guarded_task)
    params = inspect.signature(overloads[-1]).parameters
    named = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n != "app"]
    assert named == list(OPTION_NAMES)
    for name, default in option_defaults().items():
        assert params[name].default == default, name
        assert getattr(GuardedTask, ATTR_PREFIX + name) == default


def test_stored_task_ids_are_bounded_and_stable() -> None:
    assert stored_task_id("abc") == "abc"
    assert stored_task_id(None) is None
    long_id = "t" * 300
    for raw in (long_id, "a\x00b", "x\udc80y"):
        stored = stored_task_id(raw)
        assert stored is not None and stored == stored_task_id(raw)
        assert len(stored) <= MAX_STORED_ID and "\x00" not in stored
        stored.encode("utf-8")
        assert is_shortened(stored)
    assert stored_task_id(long_id) != stored_task_id(long_id + "t")
    assert not is_shortened("t" * 255)


@pytest.fixture
def app(pg_url: str) -> Iterator[Celery]:
    app = Celery("tg_struct", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=False, taskguard_database_url=pg_url
    )
    yield app
    reset_guards()


def test_finished_records_and_the_late_copy_drop(app: Celery, pg_url: str) -> None:
    guard = TaskGuard(pg_url)
    dropped: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kw: Any) -> None:
        dropped.append(kw)

    signals.late_copy_dropped.connect(receiver, weak=False)
    try:

        class Req:
            id = "t-1"
            hostname = "h"
            is_eager = False

        @guarded_task(app=app, shared=False, key="f")
        def job() -> None: ...

        run = Run(job, Req(), (), {})
        run.finished = record = Marker(
            finished_key("t-1"), finished_retention(app), Holder(job.name, "t-1", "h", 1)
        )
        assert record.key == "taskguard:finished:t-1"
        assert not run._finished_before()
        run._finish(None)  # no lease to release: the record is taken by itself
        assert run._finished_before()
        info = guard.get(record.key)
        assert info is not None and 7100 < info.expires_in.total_seconds() <= 7200
        run.key = "f"
        with pytest.raises(Ignore):
            run.late_copy()
        assert dropped == [{"signal": signals.late_copy_dropped, "key": "f", "task_id": "t-1"}]
    finally:
        signals.late_copy_dropped.disconnect(receiver)
        guard.dispose()


def test_a_finished_key_is_in_stored_form() -> None:
    # Built without normalize_key when it is stored form already; normalized otherwise.
    for task_id in ("t-1", "t" * 300, "caf\u00e9", "a\tb"):
        assert finished_key(task_id) == normalize_key(FINISHED_PREFIX + task_id)


def _lost() -> LeaseLost:
    return LeaseLost("k", "owner", "taken over (token 7)")


def test_stop_on_lease_loss_in_a_pool_thread() -> None:
    caught: list[BaseException] = []
    ready = threading.Event()
    holder: list[Interrupter] = []

    def body() -> None:
        interrupter = Interrupter("t").arm()
        holder.append(interrupter)
        assert interrupter.kind == "thread"
        ready.set()
        try:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # Python bytecode: interruptible
                time.sleep(0.01)
        except LeaseLost as exc:
            caught.append(exc)
        finally:
            interrupter.disarm()

    thread = threading.Thread(target=body)
    thread.start()
    ready.wait(5)
    t0 = time.monotonic()
    holder[0].fire(_lost())
    thread.join(10)
    assert caught and "token 7" in str(caught[0]) and isinstance(caught[0], LeaseLost)
    assert time.monotonic() - t0 < 1


def test_stop_on_lease_loss_in_the_main_thread_interrupts_a_sleep() -> None:
    interrupter = Interrupter("t").arm()
    assert interrupter.kind == "main"
    timer = threading.Timer(0.2, interrupter.fire, (_lost(),))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(LeaseLost, match="token 7"):
            time.sleep(5)
    finally:
        interrupter.disarm()
    assert time.monotonic() - t0 < 2
    interrupter.fire(_lost())  # after disarm: nothing is raised
    time.sleep(0.05)


def test_a_dropped_late_copy_is_counted() -> None:
    from prometheus_client import CollectorRegistry

    from taskguard import metrics

    registry = CollectorRegistry()
    metrics.install(registry)
    try:
        app = Celery("tg_metric", set_as_current=False)

        @app.task(name="billing.charge", shared=False)
        def charge() -> None: ...

        signals.late_copy_dropped.send(sender=charge, key="k", task_id="t")
        value = registry.get_sample_value(
            "taskguard_late_copies_dropped_total", {"task": "billing.charge"}
        )
        assert value == 1
    finally:
        metrics.uninstall()
