"""A test kit for projects using taskguard (Django or not), also a pytest plugin.

Load the plugin in your ``conftest.py``::

    pytest_plugins = ["taskguard.testing"]

Fixtures:

``taskguard_database_url``
    A migrated lock database private to the test: a SQLite file by default, or a
    fresh PostgreSQL database when ``--taskguard-server=postgresql+psycopg://…``
    (or ``$TASKGUARD_TEST_SERVER``) names a server to create it on. Its databases
    are named ``<prefix>tpl_<hex>`` (the session's migrated template) and
    ``<prefix><hex>`` (one per test); the prefix is ``tg_`` unless
    ``--taskguard-db-prefix`` (or ``taskguard_db_prefix`` in the ini file, or
    ``$TASKGUARD_TEST_DB_PREFIX``) says otherwise.
``taskguard_guard``
    A :class:`~taskguard.TaskGuard` on that database.
``taskguard_locks``
    :class:`LockChecker`: ``assert_held(key)``, ``assert_free(key)``, and
    ``use_for(celery_app)`` to point an app's guarded tasks at the database until
    the test ends (then the app's ``taskguard_database_url`` is what it was).
``taskguard_off``
    Locking off for one test (see below).

Turning locking off: ``TASKGUARD_LOCKING=off`` in the environment, or
``taskguard_locking = off`` in the pytest ini file, turns it off for the whole
run; :func:`locking_disabled` (a context manager) or the ``taskguard_off`` fixture
for a block or one test (:mod:`taskguard.unlocked`). While it is off every acquire is granted at once without
touching a database (guarded tasks always run; nothing is skipped or made to
wait), fences pass, and taskguard logs once per process, at WARNING, on the first lock
it did not take, that locking is off.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from taskguard import config, schema
from taskguard.guard import TaskGuard
from taskguard.lease import LockInfo
from taskguard.unlocked import NoLockGuard, locking_disabled, locking_off_requested

__all__ = ["assert_free", "assert_held", "locking_disabled"]

_SERVER_ENV = "TASKGUARD_TEST_SERVER"
_PREFIX_ENV = "TASKGUARD_TEST_DB_PREFIX"
#: Letters, digits and _; short enough that <prefix>tpl_<10 hex> fits PostgreSQL's 63.
_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")
_URL_SETTING = "taskguard_database_url"


# -- assertions ------------------------------------------------------------------------


def _live(guard: TaskGuard, key: str) -> list[LockInfo]:
    return [info for info in guard.get_all(key) if info.held]


def assert_held(
    guard: TaskGuard, key: str, *, task_name: str | None = None, slots: int | None = None
) -> list[LockInfo]:
    """Fail unless ``key`` has a live lease (by ``task_name``, on ``slots`` slots if
    given); returns the live rows."""
    live = _live(guard, key)
    if not live:
        raise AssertionError(f"expected {key!r} to be held, but it is free")
    if task_name is not None and not any(i.holder.task_name == task_name for i in live):
        raise AssertionError(
            f"expected {key!r} to be held by task {task_name!r}; held by: "
            + "; ".join(i.describe() for i in live)
        )
    if slots is not None and len(live) != slots:
        raise AssertionError(f"expected {slots} live lease(s) on {key!r}, found {len(live)}")
    return live


def assert_free(guard: TaskGuard, key: str) -> None:
    """Fail if ``key`` has a live lease, naming who holds it."""
    live = _live(guard, key)
    if live:
        raise AssertionError(
            f"expected {key!r} to be free; held by: " + "; ".join(i.describe() for i in live)
        )


class LockChecker:
    """The ``taskguard_locks`` fixture: assertions on one lock database."""

    def __init__(self, guard: TaskGuard, url: str) -> None:
        self.guard = guard
        self.url = url
        self._undo: list[Callable[[], None]] = []

    def assert_held(
        self, key: str, *, task_name: str | None = None, slots: int | None = None
    ) -> list[LockInfo]:
        """See :func:`assert_held`."""
        return assert_held(self.guard, key, task_name=task_name, slots=slots)

    def assert_free(self, key: str) -> None:
        """See :func:`assert_free`."""
        assert_free(self.guard, key)

    def use_for(self, app: Any) -> None:
        """Point ``app``'s guarded tasks at this database until the test ends; then
        ``app.conf.taskguard_database_url`` is what it was before (see :meth:`restore`)."""
        conf = app.conf
        present, before = _URL_SETTING in conf, conf.get(_URL_SETTING)

        def undo() -> None:
            if present:
                conf[_URL_SETTING] = before
            else:
                conf.pop(_URL_SETTING, None)

        self._undo.append(undo)
        conf[_URL_SETTING] = self.url
        config.reset_guards()

    def restore(self) -> None:
        """Undo every :meth:`use_for`, newest first (the fixture does it after the test)."""
        while self._undo:
            self._undo.pop()()
        config.reset_guards()


# -- throwaway PostgreSQL databases --------------------------------------------------------


def _admin(server: str) -> Any:
    url = make_url(server).set(database="postgres")
    return create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)


def _create_database(server: str, name: str, template: str | None = None) -> str:
    """``CREATE DATABASE name`` (a copy of ``template``) on ``server``; returns its URL."""
    engine = _admin(server)
    try:
        with engine.connect() as conn:
            clause = f' TEMPLATE "{template}"' if template else ""
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"{clause}')
    finally:
        engine.dispose()
    return make_url(server).set(database=name).render_as_string(hide_password=False)


def _prefix(config: pytest.Config) -> str:
    """The names' prefix (``--taskguard-db-prefix``, the ini, the environment, ``tg_``)."""
    prefix = (
        config.getoption("taskguard_db_prefix")
        or str(config.getini("taskguard_db_prefix") or "")
        or os.environ.get(_PREFIX_ENV)
        or "tg_"
    )
    if not _PREFIX.fullmatch(prefix):
        raise pytest.UsageError(
            f"--taskguard-db-prefix {prefix!r}: use up to 48 letters, digits and _, not "
            "starting with a digit (the test kit's database names start with it)"
        )
    return prefix


def _drop_database(server: str, name: str) -> None:
    config.reset_guards()  # pooled connections of guards on it would block the drop
    engine = _admin(server)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        engine.dispose()


# -- pytest plugin ------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("taskguard")
    group.addoption(
        "--taskguard-server",
        default=None,
        metavar="URL",
        help="PostgreSQL server URL on which taskguard_database_url creates a throwaway "
        f"database per test (default: ${_SERVER_ENV}, else a SQLite file).",
    )
    group.addoption(
        "--taskguard-db-prefix",
        default=None,
        metavar="PREFIX",
        help="Start the names of the databases the kit creates on --taskguard-server with "
        f"PREFIX (default: the ini's taskguard_db_prefix, ${_PREFIX_ENV}, else tg_).",
    )
    parser.addini(
        "taskguard_locking", "'off' turns taskguard's locking off for the whole run", default=""
    )
    parser.addini("taskguard_db_prefix", "prefix of the databases the test kit creates", default="")


_session_off: list[contextlib.ExitStack] = []


def pytest_configure(config: pytest.Config) -> None:
    _prefix(config)  # a bad prefix stops the run before any test
    if locking_off_requested(str(config.getini("taskguard_locking") or "")):
        stack = contextlib.ExitStack()
        stack.enter_context(locking_disabled())
        _session_off.append(stack)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _session_off:
        _session_off.pop().close()


@pytest.fixture(scope="session")
def _taskguard_template(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A migrated template: a SQLite file, or a PostgreSQL template database."""
    server = request.config.getoption("taskguard_server") or os.environ.get(_SERVER_ENV)
    if not server:
        path = tmp_path_factory.mktemp("taskguard") / "template.sqlite"
        schema.upgrade(f"sqlite:///{path}")
        yield str(path)
        return
    name = f"{_prefix(request.config)}tpl_{uuid.uuid4().hex[:10]}"
    url = _create_database(server, name)
    schema.upgrade(url)
    yield url
    _drop_database(server, name)


@pytest.fixture
def taskguard_database_url(
    _taskguard_template: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[str]:
    """URL of a migrated lock database private to this test."""
    if "://" not in _taskguard_template:
        path = tmp_path / "taskguard-locks.sqlite"
        shutil.copyfile(_taskguard_template, path)
        yield f"sqlite:///{path}"
        return
    template = make_url(_taskguard_template)
    name = f"{_prefix(request.config)}{uuid.uuid4().hex[:12]}"
    url = _create_database(_taskguard_template, name, template=str(template.database))
    yield url
    _drop_database(_taskguard_template, name)


@pytest.fixture
def taskguard_guard(taskguard_database_url: str) -> Iterator[TaskGuard]:
    """A :class:`~taskguard.TaskGuard` on ``taskguard_database_url``."""
    guard = TaskGuard(taskguard_database_url)
    yield guard
    guard.dispose()


@pytest.fixture
def taskguard_locks(
    taskguard_guard: TaskGuard, taskguard_database_url: str
) -> Iterator[LockChecker]:
    """:class:`LockChecker` on the test's lock database; what its ``use_for`` changed
    is undone after the test (before the database goes)."""
    checker = LockChecker(taskguard_guard, taskguard_database_url)
    yield checker
    checker.restore()


@pytest.fixture
def taskguard_off() -> Iterator[NoLockGuard]:
    """Locking off for this test (see :func:`locking_disabled`)."""
    with locking_disabled() as guard:
        yield guard
