"""taskguard.metrics: counters and histogram fed by taskguard's signals; nothing
imports prometheus_client unless asked to."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from taskguard import metrics
from taskguard.signals import (
    lease_lost,
    lock_acquired,
    lock_conflict,
    lock_released,
    locks_reaped,
)


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    reg = CollectorRegistry()
    metrics.install(reg)
    yield reg
    metrics.uninstall()


@pytest.fixture
def task() -> object:
    app = Celery("metrics-tests", set_as_current=False)

    @app.task(name="billing.charge", shared=False)
    def charge() -> None: ...

    return app.tasks["billing.charge"]


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    sample = reg.get_sample_value(name, labels)
    return 0.0 if sample is None else sample


def test_signals_feed_the_counters(registry: CollectorRegistry, task: object) -> None:
    lock_acquired.send(sender=task, key="k", lease=None)
    lock_acquired.send(sender=task, key="k", lease=None)
    lock_conflict.send(sender=task, key="k", holder=None, action="skip")
    lock_released.send(sender=task, key="k", lease=None, held_for=2.5, released=True)
    lock_released.send(sender=task, key="k", lease=None, held_for=timedelta(seconds=90),
                       released=False)  # fmt: skip
    lease_lost.send(sender=task, key="k", lease=None, reason="expired")
    locks_reaped.send(sender=task, count=1234)
    locks_reaped.send(sender=task, count=0)

    t = {"task": "billing.charge"}
    assert value(registry, "taskguard_locks_acquired_total", **t) == 2
    assert value(registry, "taskguard_lock_conflicts_total", **t, action="skip") == 1
    assert value(registry, "taskguard_locks_released_total", **t, outcome="released") == 1
    assert value(registry, "taskguard_locks_released_total", **t, outcome="expired") == 1
    assert value(registry, "taskguard_leases_lost_total", **t, reason="expired") == 1
    assert value(registry, "taskguard_locks_reaped_total", **t) == 1234
    assert value(registry, "taskguard_lock_hold_seconds_count", **t) == 2
    assert value(registry, "taskguard_lock_hold_seconds_sum", **t) == 92.5
    assert value(registry, "taskguard_lock_hold_seconds_bucket", **t, le="5.0") == 1


def test_labels_stay_bounded(registry: CollectorRegistry) -> None:
    # Outside Celery the sender is None; a free-text reason must not become a label value.
    lease_lost.send(sender=None, key="k", lease=None, reason="connection to db:5432 failed: x y")
    lock_conflict.send(sender="plain.name", key="k", holder=None, action=None)
    assert value(registry, "taskguard_leases_lost_total", task="none", reason="other") == 1
    assert value(registry, "taskguard_lock_conflicts_total", task="plain.name", action="none") == 1


def test_install_is_idempotent_and_uninstall_disconnects(task: object) -> None:
    reg = CollectorRegistry()
    first = metrics.install(reg)
    try:
        assert metrics.install(reg) is first
        lock_acquired.send(sender=task, key="k", lease=None)
        assert value(reg, "taskguard_locks_acquired_total", task="billing.charge") == 1
        other = CollectorRegistry()
        second = metrics.install(other)  # replaces the first installation
        lock_acquired.send(sender=task, key="k", lease=None)
        assert value(reg, "taskguard_locks_acquired_total", task="billing.charge") == 0
        assert value(other, "taskguard_locks_acquired_total", task="billing.charge") == 1
        assert second is not first
    finally:
        metrics.uninstall()
    lock_acquired.send(sender=task, key="k", lease=None)  # no receiver left: no error


def test_nothing_imports_prometheus_unless_asked() -> None:
    code = (
        "import sys, taskguard, taskguard.celery.reaper, taskguard.cli, taskguard.cli.celery, "
        "taskguard.metrics\n"
        "assert 'prometheus_client' not in sys.modules, 'prometheus_client was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_install_without_the_extra_names_it() -> None:
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None  # as if not installed\n"
        "import taskguard.metrics\n"
        "from taskguard import ConfigurationError\n"
        "try:\n"
        "    taskguard.metrics.install()\n"
        "except ConfigurationError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "pip install 'taskguard-sql[prometheus]'" in proc.stdout
