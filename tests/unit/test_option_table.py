"""Issue 42: ``@guarded_task`` (Celery), django.tasks' ``@guarded`` and Dramatiq's
actor options (taskguard.dramatiq, issue 43) accept or refuse every combination of
the options identically, with the same one-line message naming the task and the
option (all build the core's options, taskguard/options.py).

The one allowed difference: an option django.tasks or Dramatiq cannot honour
(:data:`LACKING`) is refused there with the core's "<option> is not supported by
django.tasks" (or "by Dramatiq"), whatever Celery says of the combination. Before the core (up to 9c52ebb) this
failed, among others, on the four combinations django.tasks accepted and Celery
refused: lock="queue_and_run" with on_conflict="wait", queue_ttl with lock="run",
retry_countdown without on_conflict="retry", wait_timeout without on_conflict="wait".
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from celery import Celery

from taskguard import guarded_task
from taskguard.exceptions import ConfigurationError

guarded = pytest.importorskip("taskguard.contrib.django_tasks").guarded
dramatiq = pytest.importorskip("dramatiq")

pytestmark = pytest.mark.django_tasks

LOCKS = ("run", "queue", "queue_and_run")
ON_CONFLICT = (None, "skip", "raise", "retry", "existing", "wait", "coalesce")
#: limit, throttle window, pending modes (coalesce is an on_conflict value above).
EXTRAS: tuple[dict[str, Any], ...] = (
    {},
    {"limit": 2},
    {"min_hold": 1},
    {"debounce": 1},
    {"debounce": 2, "debounce_max": 1},
    {"debounce_max": 3},
    {"coalesce_replace": True},
    {"stop_on_lease_loss": True},
)
RATES = (None, "3/2s")
SECONDS = ("queue_ttl", "retry_countdown", "wait_timeout")
#: What django.tasks and Dramatiq cannot do, refused there by the core naming the framework.
#: (In the order the core names them: options in declaration order, then the mode.)
LACKING = ("rate", "coalesce_replace", "debounce", "debounce_max")


def fetch(feed_url: str) -> None:
    pass


TASK = f"{fetch.__module__}.{fetch.__qualname__}"


def _combinations() -> list[dict[str, Any]]:
    out = []
    for lock, conflict, extra, rate, *given in itertools.product(
        LOCKS, ON_CONFLICT, EXTRAS, RATES, *([False, True],) * len(SECONDS)
    ):
        options: dict[str, Any] = {"key": "feed:{feed_url}", "lock": lock, **extra}
        if conflict is not None:
            options["on_conflict"] = conflict
        if rate is not None:
            options["rate"] = rate
        options.update({name: 2 for name, on in zip(SECONDS, given, strict=True) if on})
        out.append(options)
    return out


def _verdict(declare: Any, options: dict[str, Any]) -> str:
    try:
        declare(**options)
    except ConfigurationError as exc:
        return str(exc)
    return "accepted"


def _lacking(options: dict[str, Any]) -> str | None:
    named = next((f"{name}=" for name in LACKING if name in options), None)
    return named or ("on_conflict='coalesce'" if options.get("on_conflict") == "coalesce" else None)


def _dramatiq_actor() -> Any:
    from dramatiq.brokers.stub import StubBroker

    from taskguard.dramatiq import TaskGuardMiddleware

    broker = StubBroker()
    broker.add_middleware(TaskGuardMiddleware("sqlite://"))

    def declare(**options: Any) -> None:
        try:
            dramatiq.actor(fetch, broker=broker, actor_name=TASK, **options)
        finally:
            broker.actors.pop(TASK, None)

    return declare


def test_celery_django_tasks_and_dramatiq_decide_every_combination_alike() -> None:
    app = Celery("tg_table", set_as_current=False)
    actor = _dramatiq_actor()
    combos = _combinations()
    assert len(combos) == 3 * 7 * 8 * 2 * 8
    differ, refused = [], 0
    for options in combos:
        celery = _verdict(
            lambda **o: guarded_task(app=app, shared=False, name=TASK, **o)(fetch), options
        )
        lacking = _lacking(options)
        refused += celery != "accepted"
        for name, declare in (
            ("django.tasks", lambda **o: guarded(fetch, **o)),
            ("Dramatiq", actor),
        ):
            verdict = _verdict(declare, options)
            expected = f"task {TASK}: {lacking} is not supported by {name}" if lacking else celery
            if verdict != expected:
                differ.append((name, options, celery, verdict))
        if celery != "accepted":  # one line, naming the task and an option given
            assert celery.startswith(f"task {TASK}: ") and "\n" not in celery
            named = celery.split(": ", 1)[1]
            assert any(named.startswith(name) for name in options if name != "key"), celery
    assert differ == [], f"{len(differ)} differ, e.g. {differ[:3]}"
    assert 0 < refused < len(combos)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock": "queue_and_run", "on_conflict": "wait"}, "on_conflict='wait' blocks a worker"),
        ({"queue_ttl": 5}, "queue_ttl applies to lock='queue'/'queue_and_run' only"),
        ({"retry_countdown": 5}, "retry_countdown applies to on_conflict='retry' only"),
        ({"wait_timeout": 5}, "wait_timeout applies to on_conflict='wait' only"),
    ],
)
def test_the_four_combinations_django_tasks_accepted(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        guarded(fetch, **options)
    assert str(refused.value).startswith(f"task {TASK}: {message}")


#: What taskiq cannot do besides (issue 43): retry (no delayed re-send common to its
#: brokers) and wait (it would hold a thread the lease statements need).
TASKIQ_MODES = ("coalesce", "retry", "wait")


def test_taskiq_decides_every_combination_as_celery_does() -> None:
    """taskguard.taskiq's ``guarded`` (and its ``taskguard`` label, the same check):
    Celery's verdict, or the core's "<option> is not supported by taskiq"."""
    taskiq = pytest.importorskip("taskiq")
    from taskguard.taskiq import TaskguardMiddleware
    from taskguard.taskiq import guarded as taskiq_guarded

    middleware = TaskguardMiddleware("sqlite://")
    broker = taskiq.InMemoryBroker().with_middlewares(middleware)
    app = Celery("tg_table_taskiq", set_as_current=False)
    differ = []
    for options in _combinations():
        celery = _verdict(
            lambda **o: guarded_task(app=app, shared=False, name=TASK, **o)(fetch), options
        )
        task = broker.task(task_name=TASK)(fetch)
        verdict = _verdict(lambda **o: taskiq_guarded(**o)(task), options)  # noqa: B023
        named = next((f"{name}=" for name in LACKING if name in options), None)
        if named is None and options.get("on_conflict") in TASKIQ_MODES:
            named = f"on_conflict='{options['on_conflict']}'"
        expected = f"task {TASK}: {named} is not supported by taskiq" if named else celery
        if verdict != expected:
            differ.append((options, celery, verdict))
    assert differ == [], f"{len(differ)} differ, e.g. {differ[:3]}"
    # The label: checked when the broker starts (in the sender and in each worker; the
    # lowest taskiq's InMemoryBroker does not start its middlewares: called here).
    broker.task(task_name=TASK, taskguard={"key": "feed:{feed_url}", "rate": "3/2s"})(fetch)
    with pytest.raises(ConfigurationError, match=r"rate= is not supported by taskiq$"):
        asyncio.run(middleware.startup())
