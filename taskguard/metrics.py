"""Prometheus metrics for taskguard (optional: ``pip install 'taskguard-sql[prometheus]'``).

Nothing here imports ``prometheus_client`` until :func:`install` is called, and
nothing else in taskguard imports this module. Call it once per process, e.g. in
the module that creates the Celery app::

    import taskguard.metrics
    taskguard.metrics.install()          # default registry; or install(registry=...)

Metrics (label ``task`` is the Celery task name, ``none`` outside Celery):

* ``taskguard_locks_acquired_total{task}``
* ``taskguard_lock_conflicts_total{task, action}``
* ``taskguard_locks_released_total{task, outcome}``: outcome ``released``, or
  ``expired`` when the lease had already ended or been taken over
* ``taskguard_leases_lost_total{task, reason}``
* ``taskguard_locks_reaped_total{task}``: rows the reaper removed
* ``taskguard_late_copies_dropped_total{task}``: copies of a finished task id dropped
  without running (a broker redelivery)
* ``taskguard_lock_hold_seconds{task}``: histogram of how long leases were held
* ``taskguard_runs_deferred_total{task, reason}``: starts put off without a worker
  slot (reason ``rate``: over ``rate=``; ``busy``: a ``rate=`` task without
  ``on_conflict`` found the key held; ``coalesce``: a pending run re-checking a
  busy key; ``outage``: the lock database could not be reached before the body
  started, see ``taskguard_outage_retry_for``)
* ``taskguard_runs_coalesced_total{task, replaced}``: submissions merged into the
  key's pending run (``replaced="true"``: a pending run replaced by a newer one)

Under a prefork worker each child process counts its own; use prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) to export them together.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta
from typing import Any

from taskguard.exceptions import ConfigurationError
from taskguard.signals import (
    late_copy_dropped,
    lease_lost,
    lock_acquired,
    lock_conflict,
    lock_released,
    locks_reaped,
    run_coalesced,
    run_deferred,
)

__all__ = ["install"]

#: Histogram buckets for hold time (seconds): task runs from milliseconds to hours.
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 14400)

# Free-form values (e.g. an error text as a "reason") must not explode label cardinality.
_LABEL_OK = re.compile(r"^[A-Za-z0-9_.:-]{1,40}$")

_lock = threading.Lock()
# The process's current installation (a dict, so no `global` statement is needed).
_state: dict[str, TaskGuardMetrics] = {}


def _task_label(sender: Any) -> str:
    name = getattr(sender, "name", None)
    if isinstance(name, str) and name:
        return name
    if isinstance(sender, str) and sender:
        return sender
    return "none"


def _bounded(value: Any) -> str:
    text = str(value) if value is not None else "none"
    return text if _LABEL_OK.match(text) else "other"


def _seconds(value: Any) -> float | None:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class TaskGuardMetrics:
    """The counters and histogram, and the signal receivers that feed them."""

    def __init__(self, registry: Any = None, namespace: str = "taskguard") -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise ConfigurationError(
                "taskguard metrics need prometheus-client: pip install 'taskguard-sql[prometheus]'"
            ) from None
        if registry is None:
            registry = prom.REGISTRY
        self.registry = registry
        common: dict[str, Any] = {"namespace": namespace, "registry": registry}
        self.acquired = prom.Counter("locks_acquired", "Leases granted.", ["task"], **common)
        self.conflicts = prom.Counter(
            "lock_conflicts",
            "Acquire attempts that found the key held.",
            ["task", "action"],
            **common,
        )
        self.released = prom.Counter(
            "locks_released",
            "Leases given back (outcome: released or expired).",
            ["task", "outcome"],
            **common,
        )
        self.lost = prom.Counter(
            "leases_lost",
            "Leases lost while the task ran (renewal failed).",
            ["task", "reason"],
            **common,
        )
        self.reaped = prom.Counter(
            "locks_reaped", "Expired lock rows deleted by the reaper.", ["task"], **common
        )
        self.dropped = prom.Counter(
            "late_copies_dropped",
            "Copies of a finished task id dropped without running.",
            ["task"],
            **common,
        )
        self.deferred = prom.Counter(
            "runs_deferred",
            "Starts put off without holding a worker slot (rate, coalesce, outage).",
            ["task", "reason"],
            **common,
        )
        self.coalesced = prom.Counter(
            "runs_coalesced",
            "Submissions merged into (or replacing) the key's pending run.",
            ["task", "replaced"],
            **common,
        )
        self.hold_seconds = prom.Histogram(
            "lock_hold_seconds",
            "How long leases were held.",
            ["task"],
            buckets=HOLD_BUCKETS,
            **common,
        )

    # Receivers: Celery passes sender and signal plus the documented kwargs.

    def on_acquired(self, sender: Any = None, **kwargs: Any) -> None:
        self.acquired.labels(task=_task_label(sender)).inc()

    def on_conflict(self, sender: Any = None, action: Any = None, **kwargs: Any) -> None:
        self.conflicts.labels(task=_task_label(sender), action=_bounded(action)).inc()

    def on_released(
        self, sender: Any = None, held_for: Any = None, released: Any = True, **kwargs: Any
    ) -> None:
        task = _task_label(sender)
        self.released.labels(task=task, outcome="released" if released else "expired").inc()
        seconds = _seconds(held_for)
        if seconds is not None and seconds >= 0:
            self.hold_seconds.labels(task=task).observe(seconds)

    def on_lost(self, sender: Any = None, reason: Any = None, **kwargs: Any) -> None:
        self.lost.labels(task=_task_label(sender), reason=_bounded(reason)).inc()

    def on_reaped(self, sender: Any = None, count: Any = 0, **kwargs: Any) -> None:
        self.reaped.labels(task=_task_label(sender)).inc(max(int(count or 0), 0))

    def on_dropped(self, sender: Any = None, **kwargs: Any) -> None:
        self.dropped.labels(task=_task_label(sender)).inc()

    def on_deferred(self, sender: Any = None, reason: Any = None, **kwargs: Any) -> None:
        self.deferred.labels(task=_task_label(sender), reason=_bounded(reason)).inc()

    def on_coalesced(self, sender: Any = None, replaced: Any = False, **kwargs: Any) -> None:
        label = "true" if replaced else "false"
        self.coalesced.labels(task=_task_label(sender), replaced=label).inc()

    def _pairs(self) -> list[tuple[Any, Any, str]]:
        return [
            (lock_acquired, self.on_acquired, "acquired"),
            (lock_conflict, self.on_conflict, "conflict"),
            (lock_released, self.on_released, "released"),
            (lease_lost, self.on_lost, "lost"),
            (locks_reaped, self.on_reaped, "reaped"),
            (late_copy_dropped, self.on_dropped, "dropped"),
            (run_deferred, self.on_deferred, "deferred"),
            (run_coalesced, self.on_coalesced, "coalesced"),
        ]

    def connect(self) -> None:
        for signal, receiver, name in self._pairs():
            signal.connect(receiver, weak=False, dispatch_uid=f"taskguard.metrics.{name}")

    def disconnect(self) -> None:
        for signal, _receiver, name in self._pairs():
            signal.disconnect(dispatch_uid=f"taskguard.metrics.{name}")
        for metric in (
            self.acquired,
            self.conflicts,
            self.released,
            self.lost,
            self.reaped,
            self.dropped,
            self.deferred,
            self.coalesced,
            self.hold_seconds,
        ):
            self.registry.unregister(metric)


def install(registry: Any = None, *, namespace: str = "taskguard") -> TaskGuardMetrics:
    """Create the metrics in ``registry`` (default: prometheus_client's global one) and
    connect them to taskguard's signals. Idempotent for the same registry; a different
    registry replaces the previous installation. Raises :class:`ConfigurationError`
    when prometheus-client is not installed."""
    with _lock:
        current = _state.get("installed")
        if current is not None:
            if registry is None or current.registry is registry:
                return current
            current.disconnect()
            del _state["installed"]
        metrics = TaskGuardMetrics(registry, namespace)
        metrics.connect()
        _state["installed"] = metrics
        return metrics


def uninstall() -> None:
    """Disconnect the receivers and unregister the metrics (tests, reconfiguration)."""
    with _lock:
        current = _state.pop("installed", None)
        if current is not None:
            current.disconnect()
