"""An app configured only as the celery-once / celery-singleton migration guides say
(no ``taskguard_database_url``, no ``TASKGUARD_DATABASE_URL``), issue 33: the worker's
start-up check, the beat reaper and the CLI find the backend's database; tasks
published from any thread lock there, with or without the environment variable
naming another database; the rows name the task."""

from __future__ import annotations

import gc
import logging
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import celery_singleton.backends
import pytest
from celery import Celery
from celery_once import AlreadyQueued, QueueOnce
from celery_singleton import Singleton

from taskguard import TaskGuard
from taskguard.celery.reaper import reap_expired_locks
from taskguard.celery.worker import run_startup_check
from taskguard.config import ENV_DATABASE_URL, reset_guards

ONCE = "taskguard.compat.celery_once.Backend"
SINGLETON = "taskguard.compat.celery_singleton.Backend"
GUIDES = ("celery_once", "celery_singleton")


def _guide_app(guide: str, url: str, *, where: str = "backend") -> Celery:
    """The app as the guide configures it: the current app, a memory broker (nothing
    consumes: a published call's lock stays held). ``where="app"``: the URL in
    ``taskguard_database_url``, the backend given none (the guides' other form)."""
    app = Celery(f"guide-{guide}", broker="memory://")
    backend_url = url if where == "backend" else None
    if where == "app":
        app.conf.taskguard_database_url = url
    if guide == "celery_once":
        settings = {"url": backend_url, "default_timeout": 3600}
        app.conf.ONCE = {"backend": ONCE, "settings": {k: v for k, v in settings.items() if v}}
    else:
        app.conf.update(singleton_backend_class=SINGLETON, singleton_backend_url=backend_url)

    @app.task(name="guide.once", base=QueueOnce, shared=False)
    def once(n: int) -> int:
        return n

    @app.task(name="guide.single", base=Singleton, shared=False)
    def single(n: int) -> int:
        return n

    return app


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV_DATABASE_URL, raising=False)
    celery_singleton.backends._backend = None  # celery-singleton caches one per process
    reset_guards()
    yield
    reset_guards()
    celery_singleton.backends._backend = None
    gc.collect()  # the closed apps leave the process's set of apps


def _held(guard: TaskGuard) -> list[Any]:
    return guard.held()


@pytest.mark.parametrize("guide", GUIDES)
def test_the_start_up_check_finds_the_guides_database(
    guide: str, db_url: str, fresh: None, caplog: pytest.LogCaptureFixture
) -> None:
    app = _guide_app(guide, db_url)
    app.conf.taskguard_histroy = True
    with caplog.at_level(logging.INFO, logger="taskguard"):
        assert run_startup_check(app) is True
    assert ": ok (schema at " in caplog.text
    assert "unknown setting taskguard_histroy: did you mean taskguard_history?" in caplog.text


@pytest.mark.parametrize("guide", GUIDES)
def test_the_beat_reaper_reaps_the_guides_database(
    guide: str, db_url: str, guard: TaskGuard, fresh: None
) -> None:
    app = _guide_app(guide, db_url)
    assert guard.acquire("qo_gone", 0.2) is not None
    guard.release(guard.acquire("SINGLETONLOCK_gone", 60))  # type: ignore[arg-type]
    while guard.held():
        pass
    result = reap_expired_locks.apply(kwargs={"grace": 0})
    assert result.successful(), result.result
    assert result.result == 2
    assert guard.held(include_expired=True) == []
    app.close()


def _in_thread(fn: Callable[[], Any]) -> Any:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("environment", ["unset", "another database"])
@pytest.mark.parametrize("where", ["backend", "app"])
@pytest.mark.parametrize("guide", GUIDES)
def test_publishing_from_threads_locks_in_the_apps_database(
    guide: str,
    where: str,
    environment: str,
    db_url: str,
    guard: TaskGuard,
    sqlite_template: Path,
    tmp_path: Path,
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gunicorn gthread workers, thread pools: celery.current_app is another (empty)
    app in those threads. The first call comes from such a thread (celery-singleton
    keeps the backend it builds then for the whole process)."""
    shutil.copyfile(sqlite_template, tmp_path / "other.sqlite")
    other = TaskGuard(f"sqlite:///{tmp_path / 'other.sqlite'}")
    if environment != "unset":
        monkeypatch.setenv(ENV_DATABASE_URL, other.url)
    app = _guide_app(guide, db_url, where=where)
    try:
        if guide == "celery_once":
            task = app.tasks["guide.once"]
            _in_thread(lambda: task.delay(1))
            with pytest.raises(AlreadyQueued):
                task.delay(1)  # the main thread sees the thread's lock
            with pytest.raises(AlreadyQueued):
                _in_thread(lambda: task.delay(1))
            [row] = guard.held()
            assert row.key == "qo_guide.once_n-1"
        else:
            task = app.tasks["guide.single"]
            first = _in_thread(lambda: task.delay(1))
            assert task.delay(1).id == first.id  # answered with the holder
            assert _in_thread(lambda: task.delay(1)).id == first.id
            [row] = guard.held()
            assert row.holder.task_id == first.id
        assert other.held() == []  # nothing in the environment's database
    finally:
        other.dispose()
        app.close()


@pytest.mark.parametrize("guide", GUIDES)
def test_the_rows_name_the_task(guide: str, db_url: str, guard: TaskGuard, fresh: None) -> None:
    """``taskguard locks --prefix SINGLETONLOCK_`` shows the task (the TASK column)."""
    app = _guide_app(guide, db_url)
    if guide == "celery_once":
        app.tasks["guide.once"].delay(1)
        [row] = guard.held()
        assert row.holder.task_name == "guide.once"
    else:
        result = app.tasks["guide.single"].delay(1)
        [row] = guard.held()
        assert (row.holder.task_name, row.holder.task_id) == ("guide.single", result.id)
    app.close()
