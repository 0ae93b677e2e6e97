"""pytest plugin that runs celery-once's or celery-singleton's own test suite with
taskguard's backend in place of Redis (loaded by scripts/peer_suites.py, which
documents the environment it reads).

What it changes, and only this:

* Both modes, so the suites run at all on today's stack: the ``mock`` backport is
  ``unittest.mock``; ``celery.task`` (removed in Celery 5) is ``shared_task``; Redis
  ``FLUSHALL`` (celery-singleton's fixtures) only flushes the suite's own database.
* ``PEER_BACKEND=taskguard``: the configuration switch the migration guides give
  (celery-once's ``ONCE``, celery-singleton's ``singleton_backend_class`` / ``_url``);
  where a test builds or mocks the Redis backend class by name, taskguard's; the few
  Redis calls the tests make to look at or plant a lock (``get``, ``set``, ``keys``,
  ``flushall``, ``redis.lock.Lock``) are answered from ``task_locks`` by
  :class:`LockView`. Tests of Redis itself are skipped as not applicable, with why.

The lock database is the one the harness names in ``PEER_DATABASE_URL`` (its own
variable: nothing taskguard reads), given to the backends only as the guides do.

Each test is counted in a category: called taskguard (it made at least one call into
taskguard's backends: counted, not assumed), switched but never called it,
unchanged because it involves no lock store, not applicable; the terminal summary
gives the counts.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import unittest.mock
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from taskguard.compat import end_lease
from taskguard.config import guard_for
from taskguard.guard import TaskGuard

ONCE = "taskguard.compat.celery_once.Backend"
SINGLETON = "taskguard.compat.celery_singleton.Backend"

#: Tests that check Redis itself, by node id suffix: skipped in taskguard mode.
NOT_APPLICABLE = {
    "backends/test_redis.py::test_init": "checks the Redis client's connection "
    "arguments parsed from a redis:// URL",
    "unit/backends/test_redis.py::test_redis_cached_property": "counts calls of the "
    "Redis backend's URL parser; taskguard's one engine per URL per process is "
    "test_once_one_engine_per_url_per_process in tests/integration/compat",
    "test_config.py::TestBackend::test__default_backend_class__redis_backend": "checks "
    "that Redis is celery-singleton's default backend class",
}
#: Tests that run as they are in both modes (they involve no lock store), by path part.
UNCHANGED = {
    "tests/unit/test_helpers.py": "key building",
    "tests/unit/test_tasks.py": "key building",
    "backends/test_file.py": "celery-once's File backend",
    "tests/unit/backends/test_redis.py::test_parse": "celery-once's Redis URL parser",
    "tests/test_config.py": "celery-singleton's Config",
    "tests/test_backends.py::TestGetBackend": "celery-singleton's backend factory",
    "test_singleton.py::TestRaiseOnDuplicateConfig::test__task_cfg": "settings only",
    "test_singleton.py::TestRaiseOnDuplicateConfig::test__app_cfg": "settings only",
}

_TASKGUARD = os.environ.get("PEER_BACKEND", "taskguard") == "taskguard"
_URL = os.environ.get("PEER_DATABASE_URL", "")
_categories: dict[str, str] = {}
_outcomes: dict[str, str] = {}
#: Calls into taskguard's backends, per test node id (setup and teardown included).
_calls: Counter[str] = Counter()
_running = [""]
#: The backends' methods the peers call.
_ENTRY_POINTS = ("raise_or_lock", "clear_lock", "lock", "unlock", "get", "clear")


def _guard() -> TaskGuard:
    return guard_for(url=_URL)


def _counted(method: Any) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        _calls[_running[0]] += 1
        return method(*args, **kwargs)

    return call


class LockView:
    """The Redis calls the peers' tests make on locks, answered from ``task_locks``
    (built wherever a test builds ``FakeStrictRedis`` or reads ``backend.redis``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.guard = _guard()

    def get(self, key: str) -> str | None:
        """The holder's task id (celery-singleton's value), else its owner id."""
        info = self.guard.get(key)
        if info is None or not info.held:
            return None
        return info.holder.task_id or info.owner

    def set(self, key: str, value: Any, *args: Any, **kwargs: Any) -> bool:
        """A lock planted by a test: held for an hour, its value as the task id."""
        return self.guard.try_acquire(key, 3600, task_id=str(value)).lease is not None

    def keys(self, pattern: str = "*") -> list[str]:
        return [info.key for info in self.guard.held(pattern.rstrip("*"))]

    def flushall(self) -> None:
        for info in self.guard.held():
            end_lease(self.guard, info)


class HeldLock:
    """``redis.lock.Lock(redis, name, timeout=…).acquire()`` as a test uses it to
    plant a lock that expires."""

    def __init__(self, redis: LockView, name: str, timeout: float | None = None, **_: Any):
        self.guard, self.name, self.timeout = redis.guard, name, timeout or 3600

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        return self.guard.try_acquire(self.name, self.timeout).lease is not None


def pytest_configure(config: pytest.Config) -> None:
    sys.modules.setdefault("mock", unittest.mock)
    import celery
    import redis

    if not hasattr(celery, "task"):
        celery.task = celery.shared_task
    redis.Redis.flushall = lambda self, *a, **k: self.flushdb()
    if _TASKGUARD:
        from taskguard.compat.celery_once import Backend as OnceBackend
        from taskguard.compat.celery_singleton import Backend as SingletonBackend

        OnceBackend.redis = property(LockView)
        SingletonBackend.redis = property(LockView)
        for backend in (OnceBackend, SingletonBackend):
            for name in _ENTRY_POINTS:
                if name in vars(backend):
                    setattr(backend, name, _counted(vars(backend)[name]))
        if os.path.isdir("celery_singleton"):
            # Tests that build or mock "the Redis backend class" by name get taskguard's
            # (its name is bound when test modules import it, so before collection).
            import celery_singleton.backends.redis as theirs

            theirs.RedisBackend = SingletonBackend
            sys.modules["celery_singleton.backends"].RedisBackend = SingletonBackend


def _category(nodeid: str) -> tuple[str, str]:
    for part, reason in NOT_APPLICABLE.items():
        if nodeid.endswith(part) or f"{part}[" in nodeid:
            return "not applicable", reason
    for part, reason in UNCHANGED.items():
        if part in nodeid:
            return "unchanged", reason
    return ("taskguard" if _TASKGUARD else "their backend"), ""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        category, reason = _category(item.nodeid)
        if category == "not applicable" and _TASKGUARD:
            item.add_marker(pytest.mark.skip(reason=f"not applicable: {reason}"))
        _categories[item.nodeid] = category if _TASKGUARD else "their backend"


@pytest.fixture(autouse=True)
def _taskguard_backend(request: pytest.FixtureRequest) -> Iterator[None]:
    """The switch, per module, before the test body (and after the module's own
    autouse fixtures, which it asks for first)."""
    if not _TASKGUARD or _categories.get(request.node.nodeid) != "taskguard":
        yield
        return
    from taskguard.compat.celery_once import Backend as OnceBackend
    from taskguard.compat.celery_singleton import Backend as SingletonBackend

    module, url = request.module, _URL
    patch = pytest.MonkeyPatch()
    names = vars(module)
    if "FakeStrictRedis" in names:  # celery-once's Redis scenarios use fakeredis
        patch.setattr(module, "FakeStrictRedis", LockView)
        patch.setattr(module, "RedisLock", HeldLock)
    # The unit tests build the backend themselves, with the Redis URL: the lock
    # database's instead, where the guides put it (ONCE url, singleton_backend_url).
    if "Redis" in names:
        patch.setattr(module, "Redis", lambda settings: OnceBackend({**settings, "url": url}))
    if "RedisBackend" in names and "backend" in request.fixturenames:
        patch.setattr(module, "RedisBackend", lambda _redis_url, **kw: SingletonBackend(url, **kw))
    app = names.get("app")
    once = getattr(getattr(app, "conf", None), "ONCE", None)
    if once and once["backend"] != "tests.backends.TestBackend":
        patch.setitem(
            app.conf, "ONCE", {"backend": ONCE, "settings": {**once["settings"], "url": url}}
        )
    if "mock_backend" in request.fixturenames:  # QueueOnce with a spy over taskguard's
        request.getfixturevalue("mock_backend")
        real = OnceBackend({"url": url})
        spy = sys.modules["tests.backends"].TestBackend
        spy.raise_or_lock.side_effect = real.raise_or_lock
        spy.clear_lock.side_effect = real.clear_lock
    if "celery_app" in request.fixturenames:  # celery-singleton's tasks
        request.getfixturevalue("celery_app").conf.update(
            singleton_backend_class=SINGLETON, singleton_backend_url=url
        )
    LockView().flushall()
    try:
        yield
    finally:
        patch.undo()
        LockView().flushall()


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _running[0] = nodeid


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        _outcomes.setdefault(report.nodeid, report.outcome)
        if report.when == "call":
            _outcomes[report.nodeid] = report.outcome


def _final_category(nodeid: str) -> str:
    category = _categories.get(nodeid, "?")
    if category == "taskguard":
        return "called taskguard" if _calls[nodeid] else "switched, no call"
    return category


def pytest_terminal_summary(terminalreporter: Any) -> None:
    counts = Counter((_final_category(n), o) for n, o in _outcomes.items())
    terminalreporter.section("peer suite: outcomes by category")
    for (category, outcome), n in sorted(counts.items()):
        terminalreporter.write_line(f"{category:18} {outcome:8} {n}")
    if _TASKGUARD:
        called = [n for n in _outcomes if _calls[n]]
        terminalreporter.write_line(
            f"{len(called)} test(s) called taskguard's backends "
            f"({sum(_calls[n] for n in called)} calls)"
        )
    path = os.environ.get("PEER_REPORT")
    if path:
        with open(path, "w") as out:
            rows = [
                {
                    "test": n,
                    "category": _final_category(n),
                    "outcome": o,
                    "taskguard_calls": _calls[n],
                }
                for n, o in _outcomes.items()
            ]
            json.dump(rows, out, indent=1)
