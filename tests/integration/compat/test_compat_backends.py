"""taskguard's celery-once and celery-singleton backends on PostgreSQL, MariaDB and
SQLite, in this process: the backend calls the peers make, and ``QueueOnce`` /
``Singleton`` tasks run eagerly with only the configuration switched. The same
tasks on a real worker are in test_compat_workers.py."""

from __future__ import annotations

import functools
import logging
import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery_once import AlreadyQueued, QueueOnce
from celery_singleton import Singleton, clear_locks
from click.testing import CliRunner
from sqlalchemy import column, create_engine, select, table

from taskguard import ConfigurationError, TaskGuard
from taskguard.cli import main_group
from taskguard.compat import DEFAULT_EXPIRY
from taskguard.compat.celery_once import Backend as OnceBackend
from taskguard.compat.celery_singleton import Backend as SingletonBackend
from taskguard.config import guard_for, reset_guards

ONCE = "taskguard.compat.celery_once.Backend"
SINGLETON = "taskguard.compat.celery_singleton.Backend"


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    """The current app, configured as the migration guides say (eager runs)."""
    _forget_singleton_backend()
    app = Celery("compat-tests")  # current, as Celery() is by default
    app.conf.update(
        task_always_eager=True,
        taskguard_database_url=db_url,
        ONCE={"backend": ONCE, "settings": {"default_timeout": 60}},
        singleton_backend_class=SINGLETON,
        singleton_backend_url=db_url,
    )
    yield app
    reset_guards()
    _forget_singleton_backend()


def _forget_singleton_backend() -> None:
    import celery_singleton.backends

    celery_singleton.backends._backend = None  # celery-singleton caches one per process


def _row(guard: TaskGuard, key: str) -> Any:
    info = guard.get(key)
    return info if info is not None and info.held else None


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


# -- celery-once -----------------------------------------------------------------------


def test_once_duplicate_refused_with_seconds_left_and_conflict_logged(
    app: Celery, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = OnceBackend({"url": db_url})
    backend.raise_or_lock("qo_feeds.import_url-a", timeout=30)
    with caplog.at_level(logging.INFO, logger="taskguard"), pytest.raises(AlreadyQueued) as exc:
        OnceBackend({"url": db_url}).raise_or_lock("qo_feeds.import_url-a", timeout=30)
    assert 25 < exc.value.countdown <= 30
    assert "Expires in" in exc.value.message
    info = _row(backend.guard, "qo_feeds.import_url-a")
    assert f"lock 'qo_feeds.import_url-a' is held by owner {info.owner}" in _messages(caplog)

    backend.clear_lock("qo_feeds.import_url-a")
    assert _row(backend.guard, "qo_feeds.import_url-a") is None
    backend.raise_or_lock("qo_feeds.import_url-a", timeout=30)  # free again
    backend.clear_lock("qo_not-held")  # nothing to clear: no error, as Redis's DEL


def test_once_one_engine_per_url_per_process(app: Celery, db_url: str) -> None:
    """celery-once builds its backend on every publish and every run."""
    configured = OnceBackend({}).guard
    assert configured is guard_for(app)  # no url: the app's taskguard_database_url
    assert OnceBackend({"url": db_url}).guard is configured  # the same URL: the same guard
    assert OnceBackend({"url": db_url}).guard.engine is OnceBackend({}).guard.engine
    reset_guards()  # changed settings are read again, for a URL given too
    assert OnceBackend({"url": db_url}).guard is not configured


def test_once_timeout_none_is_the_default_timeout_not_forever(app: Celery, db_url: str) -> None:
    guarded = OnceBackend({"url": db_url, "default_timeout": 120})
    guarded.raise_or_lock("qo_a", timeout=None)
    assert 110 < _row(guarded.guard, "qo_a").expires_in.total_seconds() <= 120
    plain = OnceBackend({"url": db_url})
    plain.raise_or_lock("qo_b", timeout=None)
    assert DEFAULT_EXPIRY - 10 < _row(plain.guard, "qo_b").expires_in.total_seconds() <= 3600


def test_once_lock_expires_by_the_database_clock(
    app: Celery, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = OnceBackend({"url": db_url})
    backend.raise_or_lock("qo_clock", timeout=1)
    with monkeypatch.context() as m:  # a client clock a day ahead changes nothing
        m.setattr(time, "time", lambda: 1e9 + 86400 * 365 * 30)
        with pytest.raises(AlreadyQueued):
            backend.raise_or_lock("qo_clock", timeout=1)
    expires = _row(backend.guard, "qo_clock").expires_at
    while backend.guard.db_now() <= expires:
        time.sleep(0.05)
    backend.raise_or_lock("qo_clock", timeout=1)  # expired by the database's clock


def test_once_blocking_waits_for_the_key(app: Celery, db_url: str) -> None:
    backend = OnceBackend({"url": db_url, "blocking": True, "blocking_timeout": 5})
    backend.raise_or_lock("qo_wait", timeout=0.5)
    started = time.monotonic()
    backend.raise_or_lock("qo_wait", timeout=30)  # waits out the first one's 0.5 s
    assert time.monotonic() - started < 5
    with pytest.raises(ConfigurationError, match="blocking_timeout"):
        OnceBackend({"url": db_url, "blocking": True, "blocking_timeout": None})


def test_once_long_unhashed_keys_work_and_stay_identifiable(app: Celery, db_url: str) -> None:
    """celery-once's ``qo_<task>_<args>`` keys are as long as the arguments."""

    @app.task(name="feeds.import_many", base=QueueOnce, shared=False)
    def import_many(urls: list[str]) -> int:
        held = guard.held("qo_feeds.import_many_urls-")
        assert len(held) == 1 and held[0].key.startswith(key[:200])
        with pytest.raises(AlreadyQueued):  # a duplicate of a long key is refused too
            import_many.apply_async(args=(urls,))
        return len(held[0].key)

    guard = guard_for(app)
    urls = [f"https://example.com/feeds/{i}/rss.xml" for i in range(40)]
    key = import_many.get_key(args=(urls,))
    assert len(key) > 1500
    assert import_many.apply_async(args=(urls,)).get() == 255
    assert guard.held("qo_feeds.import_many") == []  # released when the run ended


# -- celery-singleton ------------------------------------------------------------------


def test_singleton_lock_get_unlock(
    app: Celery, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = SingletonBackend(db_url)
    assert backend.lock("SINGLETONLOCK_abc", "task-1") is True
    with caplog.at_level(logging.INFO, logger="taskguard"):
        assert backend.lock("SINGLETONLOCK_abc", "task-2") is False
    assert "lock 'SINGLETONLOCK_abc' is held by owner" in _messages(caplog)
    assert "id task-1" in _messages(caplog)
    assert backend.get("SINGLETONLOCK_abc") == "task-1"
    row = _row(backend.guard, "SINGLETONLOCK_abc")
    # expiry=None: an hour, not forever.
    assert DEFAULT_EXPIRY - 10 < row.expires_in.total_seconds() <= DEFAULT_EXPIRY
    backend.unlock("SINGLETONLOCK_abc")  # outside a task: whoever holds it, as DEL
    assert backend.get("SINGLETONLOCK_abc") is None
    backend.unlock("SINGLETONLOCK_abc")  # not held: nothing to do
    assert backend.lock("SINGLETONLOCK_abc", "task-3", expiry=5) is True
    assert _row(backend.guard, "SINGLETONLOCK_abc").expires_in.total_seconds() <= 5
    # Held without a task id (taken with the API): get() gives the owner id, never
    # None, or Singleton.apply_async would ask again forever.
    lease = backend.guard.acquire("SINGLETONLOCK_api", 60)
    assert lease is not None and backend.get("SINGLETONLOCK_api") == lease.owner


def test_singleton_duplicate_is_answered_with_the_holder_its_refusal_read(
    app: Celery, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """celery-singleton answers a duplicate with lock() then get(): the refused lock()
    read the holder already, so get() right after (same thread, same key) sends no
    statement; any other get() reads the database."""
    backend = SingletonBackend(db_url)
    assert backend.lock("SINGLETONLOCK_dup", "task-1") is True
    store = backend.guard._store
    sent: list[str] = []
    run = store.run

    def counted(stmt: Any, values: Any, deadline: float | None = None) -> Any:
        sent.append(stmt.sql)
        return run(stmt, values, deadline)

    monkeypatch.setattr(store, "run", counted)
    assert backend.lock("SINGLETONLOCK_dup", "task-2") is False
    refusal = len(sent)
    assert backend.get("SINGLETONLOCK_dup") == "task-1"
    assert len(sent) == refusal  # answered from the refusal
    backend.unlock("SINGLETONLOCK_dup")
    assert backend.get("SINGLETONLOCK_dup") is None  # read afresh: released
    assert backend.lock("SINGLETONLOCK_dup", "task-3") is True
    assert backend.lock("SINGLETONLOCK_other", "task-4") is True
    assert backend.lock("SINGLETONLOCK_other", "task-5") is False
    assert backend.get("SINGLETONLOCK_dup") == "task-3"  # another key: read, not the cache


def test_singleton_clear_takes_the_prefix_literally(app: Celery, db_url: str) -> None:
    """``SINGLETONLOCK_`` as a LIKE pattern would also match ``SINGLETONLOCKx…``."""
    backend = SingletonBackend(db_url)
    keys = ["SINGLETONLOCK_a", "SINGLETONLOCK_b", "SINGLETONLOCKxc", "singletonlock_d"]
    keys += ["SINGLETONLOCK", "x_SINGLETONLOCK_e", "SINGLETONLOCK%f"]
    for key in keys:
        assert backend.lock(key, f"id-{key}")
    backend.clear("SINGLETONLOCK_")
    assert [k for k in keys if backend.get(k)] == keys[2:]
    backend.clear("SINGLETONLOCK%")
    assert [k for k in keys if backend.get(k)] == keys[2:6]


def test_once_a_redis_url_left_in_its_settings_is_refused_naming_them(
    app: Celery, db_url: str
) -> None:
    """celery-once's Redis backend reads the same settings key: a redis:// URL left
    there is refused when the backend is made, naming the ONCE setting."""
    with pytest.raises(ConfigurationError, match=r"^ONCE settings url: .*redis"):
        OnceBackend({"url": "redis://127.0.0.1:6379/0"})


def test_singleton_url_falls_back_to_the_taskguard_database(app: Celery, db_url: str) -> None:
    """Without singleton_backend_url celery-singleton passes the broker's URL."""
    app.conf.update(singleton_backend_url=None, broker_url="redis://127.0.0.1:6379/0")
    assert SingletonBackend("redis://127.0.0.1:6379/0").guard is guard_for(app)
    app.conf.singleton_backend_url = "redis://127.0.0.1:6379/0"
    with pytest.raises(ConfigurationError, match=r"^singleton_backend_url: .*redis"):
        SingletonBackend("redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigurationError, match=r"socket_timeout.*Redis client options"):
        SingletonBackend(db_url, socket_timeout=5)


def test_singleton_tasks_answer_duplicates_with_the_holder_and_release_at_the_end(
    app: Celery,
) -> None:
    seen: dict[str, Any] = {}

    @app.task(name="reports.build", base=Singleton, bind=True, shared=False, lock_expiry=60)
    def build(self: Any, report: int) -> str:
        lock = self.generate_lock(self.name, [report])
        seen["row"] = _row(self.singleton_backend.guard, lock)
        seen["duplicate"] = build.apply_async(args=[report]).id  # answered, not queued
        return str(self.request.id)

    first = build.apply_async(args=[7])
    assert first.get() == first.id
    assert seen["row"].holder.task_id == first.id  # the row names the task
    assert 50 < seen["row"].expires_in.total_seconds() <= 60  # lock_expiry
    assert seen["duplicate"] == first.id
    lock = build.generate_lock(build.name, [7])
    assert build.singleton_backend.get(lock) is None  # released when the task ended
    assert build.apply_async(args=[7]).id != first.id


def test_singleton_task_never_ends_a_lease_taken_after_its_own(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """A task that outlived its expiry must not end the lease of the copy queued since."""

    @app.task(name="reports.slow", base=Singleton, bind=True, shared=False)
    def slow(self: Any, report: int) -> None:
        lock = self.generate_lock(self.name, [report])
        backend = self.singleton_backend
        backend.guard.force_release(lock)  # as if its expiry had passed ...
        assert backend.lock(lock, "the-next-copy", expiry=60)  # ... and a copy was queued

    with caplog.at_level(logging.WARNING, logger="taskguard"):
        slow.apply_async(args=[1]).get()
    lock = slow.generate_lock(slow.name, [1])
    assert slow.singleton_backend.get(lock) == "the-next-copy"
    assert f"not releasing {lock!r} for task" in _messages(caplog)
    assert "id the-next-copy" in _messages(caplog)
    clear_locks(app)  # the operator's way: whoever holds them
    assert slow.singleton_backend.get(lock) is None


# -- the rows: visible, expired, reaped ----------------------------------------------------


def _wrapped(method: Any) -> Any:
    """A decorator as a user's code may put around a task method."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return call


def test_the_rows_name_the_task_through_a_wrapped_or_subclassed_backend(
    app: Celery, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41, defect 8b: the task name was read two frames up the stack, so a
    backend method wrapped (a decorator) or overridden by a subclass calling super()
    recorded none."""
    import celery_singleton.backends

    monkeypatch.setattr(OnceBackend, "raise_or_lock", _wrapped(OnceBackend.raise_or_lock))

    class MySingletonBackend(SingletonBackend):
        def lock(self, lock: str, task_id: str, expiry: float | None = None) -> bool:
            return super().lock(lock, task_id, expiry)

    celery_singleton.backends._backend = MySingletonBackend(db_url)
    seen: dict[str, Any] = {}

    @app.task(name="feeds.fetch_url", base=QueueOnce, bind=True, shared=False)
    def fetch(self: Any, url: str) -> None:
        seen["once"] = _row(self.once_backend.guard, self.get_key(kwargs={"url": url}))

    @app.task(name="reports.build_all", base=Singleton, bind=True, shared=False)
    def build(self: Any, report: int) -> None:
        lock = self.generate_lock(self.name, [report])
        seen["singleton"] = _row(self.singleton_backend.guard, lock)

    fetch.apply_async(kwargs={"url": "https://example.com/a_b"})
    build.apply_async(args=[1])
    assert seen["once"].holder.task_name == "feeds.fetch_url"
    assert seen["singleton"].holder.task_name == "reports.build_all"
    backend = OnceBackend({"default_timeout": 60})
    backend.raise_or_lock("qo_feeds.fetch_url_url-x", timeout=30)  # outside any task
    assert _row(backend.guard, "qo_feeds.fetch_url_url-x").holder.task_name == "feeds.fetch_url"


def test_rows_are_visible_in_the_view_and_taskguard_locks_then_reaped(
    app: Celery, db_url: str
) -> None:
    # Locks that outlive the listing however loaded the machine (with 0.5 s expiries a
    # busy 2-core machine saw them expire before `taskguard locks` ran); then ended by
    # hand, so the reaper finds them expired without waiting.
    once, single = OnceBackend({}), SingletonBackend(db_url)
    once.raise_or_lock("qo_feeds.import_url-a", timeout=60)
    single.lock("SINGLETONLOCK_0cc175b9", "task-42", expiry=60)
    engine, view = create_engine(db_url), table("task_locks_held")
    try:
        with engine.connect() as conn:
            held = conn.execute(select(column("key"), column("task_id")).select_from(view)).all()
        assert sorted(held) == [
            ("SINGLETONLOCK_0cc175b9", "task-42"),
            ("qo_feeds.import_url-a", None),
        ]
    finally:
        engine.dispose()
    out = CliRunner().invoke(main_group, ["locks", "--database-url", db_url])
    assert out.exit_code == 0, out.output
    assert "qo_feeds.import_url-a" in out.output and "SINGLETONLOCK_0cc175b9" in out.output
    guard = once.guard
    for key in ("qo_feeds.import_url-a", "SINGLETONLOCK_0cc175b9"):
        assert 30 < _row(guard, key).expires_in.total_seconds() <= 60  # the expiry given
        assert guard.force_release(key)
    assert guard.held() == []
    assert guard.reap(grace=0) == 2
    assert guard.held(include_expired=True) == []


def _child_locks(settings: dict[str, str], key: str) -> None:
    OnceBackend(settings).raise_or_lock(key, timeout=30)


def test_a_forked_child_uses_its_own_connections(app: Celery, db_url: str) -> None:
    """Prefork workers fork after the parent has used the backend."""
    backend = OnceBackend({"url": db_url})
    backend.raise_or_lock("qo_parent", timeout=30)
    child = multiprocessing.get_context("fork").Process(
        target=_child_locks, args=({"url": db_url}, "qo_child")
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    with pytest.raises(AlreadyQueued):
        backend.raise_or_lock("qo_child", timeout=30)  # the child's lock, seen by the parent
    backend.clear_lock("qo_parent")
    backend.raise_or_lock("qo_parent", timeout=30)  # the parent's connection still works
