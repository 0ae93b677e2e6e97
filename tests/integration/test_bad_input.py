"""Bad input (issue #7, item 8): every bad value gets a clear error naming the
problem, and no row is written, changed or half-written.

Hypothesis drives keys (unicode, NUL, surrogates, 10 kB, SQL metacharacters,
wrong types), TTLs (<= 0, NaN, inf, huge, wrong types) and unserialisable task
arguments against real PostgreSQL and SQLite. CI runs a few dozen examples per
property; ``TASKGUARD_CHAOS_EXAMPLES=10000`` (scripts/chaos.py) runs the full set.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, delete, select
from sqlalchemy.engine import make_url

from taskguard import (
    ConfigurationError,
    DatabaseUnavailable,
    InvalidKey,
    InvalidTTL,
    OutcomeUnknown,
    PermissionDenied,
    SchemaMissing,
    TaskGuard,
    TaskGuardError,
    guarded_task,
)
from taskguard.config import reset_guards
from taskguard.models import TaskLock
from taskguard.validation import MAX_KEY_LENGTH, MAX_TTL, MIN_TTL, normalize_key

EXAMPLES = int(os.environ.get("TASKGUARD_CHAOS_EXAMPLES", "40"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

SQL_META = [
    "'", "''", '"', ";", "--", "/*", "*/", "\\", "%", "_", "$1", ":key", "?", "%s",
    "' OR '1'='1", "'); DROP TABLE task_locks; --", "\x00", "\u202e", "\ufeff", "🔒",
]  # fmt: skip

keys = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(exclude_categories=())),  # NUL, lone surrogates
    st.lists(st.sampled_from(SQL_META) | st.text(max_size=3)).map("".join),
    st.builds(lambda s, n: s * n, st.text(min_size=1, max_size=4), st.integers(2_500, 10_500)),
    st.sampled_from([None, 1, b"key", ["key"], 3.5, object()]),
)

ttls = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=MIN_TTL, max_value=MAX_TTL),
    st.integers(min_value=-(10**15), max_value=10**15),
    st.timedeltas(),
    st.sampled_from([None, "5", True, False, Decimal("5"), Fraction(1, 2), complex(1, 0), [5]]),
)


class Table:
    """Reads the whole lock table, to prove a refused call changed nothing."""

    def __init__(self, url: str) -> None:
        self.engine = create_engine(url)

    def snapshot(self) -> list[tuple[Any, ...]]:
        locks = TaskLock.__table__
        with self.engine.connect() as conn:
            query = select(locks).order_by(locks.c.key, locks.c.slot)
            return [tuple(r) for r in conn.execute(query).all()]

    def delete(self, key: str) -> None:
        locks = TaskLock.__table__
        with self.engine.begin() as conn:
            conn.execute(delete(locks).where(locks.c.key == key))


@pytest.fixture
def table(db_url: str) -> Iterator[Table]:
    t = Table(db_url)
    yield t
    t.engine.dispose()


@pytest.fixture
def sentinel(guard: TaskGuard) -> str:
    """A live lease held by someone else throughout: it must never change."""
    lease = guard.acquire("sentinel", 3600, task_name="sentinel")
    assert lease is not None
    return lease.owner


def _expected_ttl(ttl: object) -> float | None:
    """The seconds a valid ttl stands for, or None if it must be refused."""
    if isinstance(ttl, timedelta):
        seconds = ttl.total_seconds()
    elif isinstance(ttl, (int, float)) and not isinstance(ttl, bool):
        seconds = float(ttl)
    else:
        return None
    return seconds if math.isfinite(seconds) and MIN_TTL <= seconds <= MAX_TTL else None


@SETTINGS
@given(key=keys)
def test_any_key_is_stored_exactly_or_refused(
    key: object, guard: TaskGuard, table: Table, sentinel: str
) -> None:
    before = table.snapshot()
    try:
        stored = normalize_key(key)
    except InvalidKey as exc:
        assert isinstance(exc, ValueError)
        with pytest.raises(InvalidKey) as refused:
            guard.acquire(key, 30)  # type: ignore[arg-type]
        assert str(refused.value) == str(exc) and "key" in str(exc)
        assert table.snapshot() == before
        return
    assert 0 < len(stored) <= MAX_KEY_LENGTH
    lease = guard.acquire(key, 30)  # type: ignore[arg-type]
    if stored == "sentinel":
        assert lease is None
        return
    try:
        assert lease is not None and lease.key == stored
        info = guard.get(key)  # type: ignore[arg-type]
        assert info is not None and info.key == stored and info.owner == lease.owner
        assert any(i.owner == lease.owner for i in guard.held(prefix=stored))
        assert guard.release(lease) is True
    finally:
        table.delete(stored)
    assert table.snapshot() == before


@SETTINGS
@given(ttl=ttls, renew_ttl=ttls)
def test_ttl_is_validated_before_anything_is_written(
    ttl: object, renew_ttl: object, guard: TaskGuard, table: Table, sentinel: str
) -> None:
    before = table.snapshot()
    seconds = _expected_ttl(ttl)
    if seconds is None:
        with pytest.raises(InvalidTTL) as refused:
            guard.acquire("ttl", ttl)  # type: ignore[arg-type]
        assert isinstance(refused.value, ValueError) and "ttl" in str(refused.value)
        assert table.snapshot() == before
        return
    lease = guard.acquire("ttl", ttl)  # type: ignore[arg-type]
    try:
        assert lease is not None
        slack = 1e-3 if guard.dialect_name == "sqlite" else 2e-6 * max(1.0, seconds / 1e6)
        assert abs((lease.expires_at - lease.acquired_at).total_seconds() - seconds) <= slack
        row = table.snapshot()
        # renew(lease, None) means "for the lease's own ttl again".
        renew_seconds = seconds if renew_ttl is None else _expected_ttl(renew_ttl)
        if renew_seconds is None:
            with pytest.raises(InvalidTTL):
                guard.renew(lease, renew_ttl)  # type: ignore[arg-type]
            assert table.snapshot() == row
        elif seconds > 0.05:  # a shorter lease may legitimately be gone already
            assert guard.renew(lease, renew_ttl) is True  # type: ignore[arg-type]
    finally:
        table.delete("ttl")
    assert table.snapshot() == before


def test_huge_integer_ttl_is_refused_clearly(sqlite_url: str) -> None:
    guard = TaskGuard(sqlite_url)
    try:
        with pytest.raises(InvalidTTL):
            guard.acquire("huge", 10**400)
    finally:
        guard.dispose()


# -- holder details the column cannot hold ---------------------------------------------

_DETAILS = [
    ("task_name", "x" * 300),
    ("task_name", "a\x00b"),
    ("task_id", "y" * 256),
    ("hostname", "h\x00"),
    ("task_name", "\ud800"),
    ("slot", 70_000),
    ("slot", -1),
    ("pid", 2**40),
]


@pytest.mark.parametrize(
    ("field", "value"), _DETAILS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(_DETAILS)]
)
def test_holder_details_out_of_range_are_refused_clearly(
    field: str, value: object, pg_guard: TaskGuard, pg_url: str
) -> None:
    table = Table(pg_url)
    before = table.snapshot()
    try:
        with pytest.raises(TaskGuardError) as refused:
            pg_guard.acquire("details", 30, **{field: value})  # type: ignore[arg-type]
        assert isinstance(refused.value, ValueError), type(refused.value)
        assert not isinstance(refused.value, DatabaseUnavailable)
        assert field in str(refused.value)
        assert table.snapshot() == before
    finally:
        table.engine.dispose()


# -- unserialisable task arguments ---------------------------------------------------------

weird_args = st.one_of(
    st.sampled_from([object(), lambda: 1, {1, 2}, complex(1, 2), Ellipsis, type, range(3)]),
    st.binary(min_size=1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet=st.characters(exclude_categories=())),
    st.dictionaries(st.integers(), st.integers(), min_size=1),
)


@pytest.fixture
def queued_tasks(pg_url: str) -> Iterator[tuple[Any, Any]]:
    """Two lock="queue" tasks on an in-memory broker (nothing consumes): one keyed
    by a digest of all its arguments, one by a template over ``feed`` only."""
    app = Celery("tg_badargs", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(task_serializer="json", taskguard_database_url=pg_url)

    # shared=False: a shared task would be added to every app made after this fixture.
    @guarded_task(app=app, shared=False, name="badargs.by_args", lock="queue", ttl=60)
    def by_args(feed: str, extra: Any) -> None:
        pass

    @guarded_task(
        app=app, shared=False, name="badargs.by_template", key="feed:{feed}", lock="queue", ttl=60
    )
    def by_template(feed: str, extra: Any) -> None:
        pass

    yield by_args, by_template
    reset_guards()


@SETTINGS
@given(value=weird_args)
def test_unserialisable_task_arguments_leave_no_lock_behind(
    value: Any, queued_tasks: tuple[Any, Any], pg_guard: TaskGuard
) -> None:
    for task in queued_tasks:
        published = False
        try:
            task.apply_async(args=("f", value))
            published = True
        except InvalidKey as exc:  # the key cannot be derived from these arguments
            assert "extra" in str(exc), exc
        except Exception as exc:  # the message cannot be serialised
            assert type(exc).__name__ == "EncodeError", exc
        held = pg_guard.held()
        if published:
            # The queued message holds its lock until a worker starts it.
            assert [i.holder.task_name for i in held] == [task.name]
        else:
            # Refused: no lock may be left behind for a message that does not exist.
            assert held == [], [i.describe() for i in held]
        for info in held:
            pg_guard.force_release(info.key)


def test_lone_surrogate_argument_gets_a_key(
    queued_tasks: tuple[Any, Any], pg_guard: TaskGuard
) -> None:
    by_args, _ = queued_tasks
    by_args.apply_async(args=("f", "\ud800"))
    assert [i.holder.task_name for i in pg_guard.held()] == [by_args.name]


# -- database URLs ------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["not a url", "", "foo://x/y", None, 42])
def test_unusable_url_is_a_configuration_error(url: Any) -> None:
    with pytest.raises(ConfigurationError):
        TaskGuard(url)


_NOWHERE = [
    "postgresql+psycopg://u:s3cret@127.0.0.1:1/x",
    "postgresql+psycopg://u:s3cret@nonexistent.invalid/x",
    "sqlite:////nonexistent/dir/locks.sqlite",
]


@pytest.mark.parametrize("url", _NOWHERE)
def test_url_pointing_nowhere_reads_fail_clearly(url: str) -> None:
    guard = TaskGuard(url)
    try:
        for call in (lambda: guard.get("k"), lambda: guard.held(), guard.db_now):
            with pytest.raises(DatabaseUnavailable) as err:
                call()
            assert "s3cret" not in str(err.value)
            assert guard.url in str(err.value)
    finally:
        guard.dispose()


@pytest.mark.parametrize("url", _NOWHERE)
def test_url_pointing_nowhere_acquire_says_unreachable(url: str) -> None:
    guard = TaskGuard(url)
    try:
        with pytest.raises(DatabaseUnavailable) as err:
            guard.acquire("k", 5)
        assert not isinstance(err.value, OutcomeUnknown), str(err.value)
    finally:
        guard.dispose()


def test_database_without_schema_says_how_to_fix(empty_pg_url: str) -> None:
    guard = TaskGuard(empty_pg_url)
    try:
        with pytest.raises(SchemaMissing, match="taskguard db upgrade"):
            guard.acquire("k", 5)
    finally:
        guard.dispose()


# -- the database refuses us, or the URL names a driver taskguard does not use (issue 27) --


def _taskguard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from taskguard.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("taskguard: "), proc.stderr
    return lines[0]


def _refused_urls(maria_url: str, pg_url: str) -> dict[str, tuple[str, str]]:
    """(wrong password, missing database) URLs on both servers."""
    maria, pg = make_url(maria_url), make_url(pg_url)
    return {
        "mariadb": (
            maria.set(username="tg_nobody", password="wrong").render_as_string(False),
            maria.set(database="tg_no_such_db").render_as_string(False),
        ),
        "postgresql": (
            pg.set(username="tg_nobody", password="wrong").render_as_string(False),
            pg.set(database="tg_no_such_db").render_as_string(False),
        ),
    }


@pytest.mark.parametrize("server", ["mariadb", "postgresql"])
def test_wrong_password_and_missing_database_say_so(
    server: str, maria_url: str, pg_url: str
) -> None:
    """A wrong password was reported as a missing privilege; a missing database as a
    refused lock statement, with no hint to create it."""
    wrong_login, no_database = _refused_urls(maria_url, pg_url)[server]
    guard = TaskGuard(wrong_login)
    try:
        with pytest.raises(PermissionDenied) as err:
            guard.acquire("k", 5)
        text = str(err.value)
        assert "refused the login" in text and "user name and password" in text, text
        assert "privilege" not in text and "wrong" not in text  # the password stays hidden
    finally:
        guard.dispose()
    guard = TaskGuard(no_database)
    try:
        with pytest.raises(DatabaseUnavailable) as err:
            guard.acquire("k", 5)
        assert "does not exist" in str(err.value) and "CREATE DATABASE" in str(err.value)
    finally:
        guard.dispose()
    line = _one_line(_taskguard("db", "upgrade", "--database-url", no_database), 2)
    assert "does not exist" in line and "CREATE DATABASE" in line, line
    line = _one_line(_taskguard("check", "--database-url", wrong_login), 1)
    assert "refused the login" in line and "unreachable" not in line, line
    line = _one_line(_taskguard("check", "--database-url", no_database), 1)
    assert "does not exist" in line and "CREATE DATABASE" in line, line


def test_an_unsupported_driver_is_named_with_the_supported_ones(maria_url: str) -> None:
    url = make_url(maria_url).set(drivername="mysql+mysqlconnector").render_as_string(False)
    with pytest.raises(ConfigurationError) as err:
        TaskGuard(url)
    for problem in (
        err.value,
        _one_line(_taskguard("db", "upgrade", "--database-url", url), 2),
        _one_line(_taskguard("check", "--database-url", url), 1),
    ):
        text = str(problem)
        assert "does not support the mysqlconnector driver" in text, text
        assert "mysql:// (mysqlclient" in text and "mysql+pymysql://" in text, text
        assert "invalid database URL" not in text, text
