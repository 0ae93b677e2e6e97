"""Issue 17 options: rate= parsing, coalesce/debounce combinations, the metrics
they feed, and the companion rows `show`/`explain` describe (no broker, no worker;
the behaviour with real workers is in tests/integration/celery/test_coalesce.py)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from taskguard import TaskGuard, guarded_task, metrics
from taskguard.companions import companion_key, describe_companions
from taskguard.config import reset_guards
from taskguard.exceptions import ConfigurationError
from taskguard.lease import Holder, LockInfo
from taskguard.options import Conflict, Rate, parse_rate
from taskguard.signals import run_coalesced, run_deferred


def test_rate_without_on_conflict_defers_a_busy_start() -> None:
    """Issue 33, defect 6: rate= alone defers a start that finds the key held; an
    explicit on_conflict stays the user's choice."""
    opts = _define(rate="3/2s")
    assert (opts.on_conflict, opts.conflict) == (None, Conflict.DEFER)
    assert _define(rate="3/2s", on_conflict="skip").conflict is Conflict.SKIP
    assert _define(rate="3/2s", on_conflict="raise").conflict is Conflict.RAISE
    assert _define().conflict is Conflict.SKIP and _define().on_conflict is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3/2s", Rate(3, 2.0)),
        ("10/m", Rate(10, 60.0)),
        ("1/h", Rate(1, 3600.0)),
        ("5/1.5s", Rate(5, 1.5)),
        ("2/15m", Rate(2, 900.0)),
        ("7/d", Rate(7, 86400.0)),
        (" 4 / 3 ", Rate(4, 3.0)),
        ((3, 2), Rate(3, 2.0)),
        ((3, timedelta(minutes=1)), Rate(3, 60.0)),
        (None, None),
    ],
)
def test_rate_forms(text: Any, expected: Rate | None) -> None:
    assert parse_rate("app.t", text) == expected


@pytest.mark.parametrize("bad", ["3", "3/", "/2s", "0/s", "3/0s", "3/2x", "-1/s", 3, "a/s",
                                 (0, 1), (3, -1), (True, 1), "3/2s/1"])  # fmt: skip
def test_bad_rates_name_the_task_and_the_forms(bad: object) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_rate("app.t", bad)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("task app.t: rate=") and "'3/2s'" in message


def _define(**options: Any) -> Any:
    app = Celery("pending-options", set_as_current=False)

    @guarded_task(app=app, shared=False, name="app.feed", key="feed:{url}", **options)
    def feed(url: str) -> None: ...

    return feed.taskguard_options


def test_options_are_built_once() -> None:
    opts = _define(on_conflict="coalesce", coalesce_replace=True, rate="10/m")
    assert opts.rate == Rate(10, 60.0) and opts.pending_runs
    opts = _define(debounce=1, debounce_max=5)
    assert (opts.debounce, opts.debounce_max, opts.pending_runs) == (1.0, 5.0, True)
    assert not _define().pending_runs


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"on_conflict": "coalesce", "lock": "queue"}, "needs lock='run'"),
        ({"coalesce_replace": True}, "coalesce_replace applies"),
        ({"coalesce_replace": "yes", "on_conflict": "coalesce"}, "True or False"),
        ({"debounce": 1, "on_conflict": "retry"}, "no on_conflict"),
        ({"debounce": 1, "lock": "queue_and_run"}, "needs lock='run'"),
        ({"debounce_max": 5}, "debounce_max applies"),
        ({"debounce": 5, "debounce_max": 1}, "must be at least"),
        ({"debounce": -1}, "debounce"),
        ({"rate": "3/2s", "lock": "queue"}, "rate="),
        ({"rate": "fast"}, "rate='fast'"),
    ],
)
def test_bad_combinations_are_refused_at_definition(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        _define(**options)
    assert words in str(info.value) and "app.feed" in str(info.value)


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    reg = CollectorRegistry()
    metrics.install(reg)
    yield reg
    metrics.uninstall()


def test_deferrals_and_merges_are_counted(registry: CollectorRegistry) -> None:
    app = Celery("pending-metrics", set_as_current=False)

    @app.task(name="app.feed", shared=False)
    def feed() -> None: ...

    run_deferred.send(sender=feed, key="k", task_id="a", reason="rate", countdown=1.0)
    run_deferred.send(sender=feed, key="k", task_id="a", reason="coalesce", countdown=0.25)
    run_coalesced.send(sender=feed, key="k", task_id="b", into="a", replaced=False)
    run_coalesced.send(sender=feed, key="k", task_id="a", into="c", replaced=True)

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"task": "app.feed", **labels}) or 0.0

    assert value("taskguard_runs_deferred_total", reason="rate") == 1
    assert value("taskguard_runs_deferred_total", reason="coalesce") == 1
    assert value("taskguard_runs_coalesced_total", replaced="false") == 1
    assert value("taskguard_runs_coalesced_total", replaced="true") == 1


def _row(key: str, slot: int, task_id: str, age: float, left: float) -> LockInfo:
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    return LockInfo(
        key=key, slot=slot, owner="o", token=1,
        acquired_at=now - timedelta(seconds=age), expires_at=now + timedelta(seconds=left),
        holder=Holder(task_name="app.feed", task_id=task_id), read_at=now,
    )  # fmt: skip


def test_companion_rows_are_described() -> None:
    pending = companion_key("feed:a", "pending", "app.feed")
    assert pending == "feed:a#pending:app.feed"
    rows = [
        _row(pending, 0, "p-1", 3, 10),
        _row(companion_key("feed:a", "pending", "app.other"), 0, "p-2", 1, 10),
        _row("feed:a#rate", 0, "r", 1, 4),
        _row("feed:a#rate", 1, "r", 2, 3),
        _row("feed:a#rate", 2, "r", 9, -1),  # its window is over
        _row("feed:a#ratex", 0, "x", 1, 4),  # another key, not a companion
    ]
    lines = describe_companions(
        "feed:a", lambda prefix: [r for r in rows if r.key.startswith(prefix)]
    )
    assert lines == [
        "pending run: task p-1 (app.feed), waiting 3.0s; starts when 'feed:a' is free",
        "pending run: task p-2 (app.feed), waiting 1.0s; starts when 'feed:a' is free",
        "rate: 2 start(s) in the current window; the next slot frees in 3.0s",
    ]
    assert describe_companions("feed:b", lambda prefix: []) == []
    with pytest.raises(ValueError, match="unknown companion role"):
        companion_key("k", "queue")


# -- eager mode (no broker: a deferral is not re-run) -----------------------------------


@pytest.fixture
def eager(sqlite_url: str) -> Iterator[tuple[Celery, TaskGuard]]:
    app = Celery("tg_pending_eager", broker="memory://", backend="cache+memory://",
                 set_as_current=False)  # fmt: skip
    app.conf.update(
        task_always_eager=True, task_eager_propagates=False, taskguard_database_url=sqlite_url
    )
    guard = TaskGuard(sqlite_url)
    yield app, guard
    guard.dispose()
    reset_guards()


def test_eager_coalesce_runs_when_free_and_is_not_rerun_when_held(
    eager: tuple[Celery, TaskGuard],
) -> None:
    app, guard = eager

    @guarded_task(app=app, shared=False, name="e.co", key="co:{n}", on_conflict="coalesce")
    def co(n: int) -> int:
        return n

    assert co.delay(1).get() == 1
    held = guard.acquire("co:2", 30)
    assert held is not None
    first = co.delay(2)
    assert first.state == "RETRY"
    # The eager pending run gave its place up: the next one is not merged into it.
    place = guard.get("co:2#pending")
    assert place is None or not place.held
    assert co.delay(2).state == "RETRY"
    guard.release(held)
    assert co.delay(2).get() == 2


def test_eager_rate_defers_the_start_over_the_rate(eager: tuple[Celery, TaskGuard]) -> None:
    app, _ = eager

    @guarded_task(app=app, shared=False, name="e.rate", key="r", limit=5, rate="2/10s")
    def rated() -> str:
        return "ran"

    states = [rated.delay().state for _ in range(3)]
    assert states == ["SUCCESS", "SUCCESS", "RETRY"]


def test_eager_debounce_runs_at_once(eager: tuple[Celery, TaskGuard]) -> None:
    app, _ = eager

    @guarded_task(app=app, shared=False, name="e.db", key="d", debounce=5, debounce_max=30)
    def debounced(n: int) -> int:
        return n

    assert [debounced.delay(i).get() for i in range(3)] == [0, 1, 2]
