"""OpenTelemetry for taskguard (optional: ``pip install 'taskguard-sql[otel]'``).

:func:`instrument` connects receivers to taskguard's signals (taskguard.signals) and
turns each into a span event on the current span: inside a Celery task run traced by
opentelemetry-instrumentation-celery that is the task's ``run/<task>`` span; on the
publishing side whatever span is current there. With no recording span current, a
short span of its own is made instead (``taskguard.acquire``, ``taskguard.release``,
``taskguard.renew``), so nothing is dropped. A run of ``on_conflict="wait"`` refused
after waiting gets a ``taskguard.wait`` span covering the wait. Nothing imports
``opentelemetry`` until :func:`instrument` is called, and with no receiver
connected the signals are not even sent: uninstrumented, this costs nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from taskguard import signals
from taskguard.exceptions import ConfigurationError

__all__ = ["instrument", "uninstrument"]

#: Span event names, and the span made instead when no recording span is current.
_NAMES = {
    "acquired": "taskguard.acquire",
    "refused": "taskguard.acquire",
    "released": "taskguard.release",
    "lost": "taskguard.renew",
}

_lock = threading.Lock()
# The process's current receivers (a dict, so no `global` statement is needed).
_state: dict[str, _Recorder] = {}


class _Recorder:
    """The signal receivers, recording with ``tracer``."""

    def __init__(self, tracer_provider: Any, record_keys: bool) -> None:
        try:
            from opentelemetry import trace
        except ImportError:
            raise ConfigurationError(
                "taskguard.otel needs opentelemetry-api: pip install 'taskguard-sql[otel]'"
            ) from None
        self.trace = trace
        self.tracer = trace.get_tracer("taskguard", tracer_provider=tracer_provider)
        self.record_keys = record_keys

    def _pairs(self) -> list[tuple[Any, Any, str]]:
        return [
            (signals.lock_acquired, self.on_acquired, "acquired"),
            (signals.lock_conflict, self.on_conflict, "conflict"),
            (signals.lock_released, self.on_released, "released"),
            (signals.lease_lost, self.on_lost, "lost"),
        ]

    def connect(self) -> None:
        for signal, receiver, name in self._pairs():
            signal.connect(receiver, weak=False, dispatch_uid=f"taskguard.otel.{name}")

    def disconnect(self) -> None:
        for signal, _receiver, name in self._pairs():
            signal.disconnect(dispatch_uid=f"taskguard.otel.{name}")

    def _attributes(self, sender: Any, key: Any, outcome: str) -> dict[str, Any]:
        """phase, strategy and limit from the task's options (none outside Celery)."""
        attributes: dict[str, Any] = {"taskguard.lock.outcome": outcome}
        opts = getattr(sender, "taskguard_options", None)
        if opts is not None:
            # Sent outside the task's own run: its publish (a queue phase).
            in_run = not getattr(sender.request, "called_directly", True)
            attributes["taskguard.lock.phase"] = "run" if in_run else "queue"
            attributes["taskguard.lock.strategy"] = str(opts.conflict)
            attributes["taskguard.lock.limit"] = opts.limit
        if self.record_keys and key is not None:
            attributes["taskguard.lock.key"] = str(key)
        return attributes

    def _record(self, what: str, attributes: dict[str, Any], waited: float | None = None) -> None:
        """An event on the current span; a span of its own when there is none (or a
        ``taskguard.wait`` span when the wait's length is known)."""
        current = self.trace.get_current_span()
        if waited is None and current.is_recording():
            current.add_event(f"taskguard.lock.{what}", attributes)
            return
        now = time.time_ns()
        name = _NAMES[what] if waited is None else "taskguard.wait"
        start = now - int(waited * 1e9) if waited is not None else now
        span = self.tracer.start_span(name, start_time=start, attributes=attributes)
        if "error.type" in attributes:
            span.set_status(self.trace.Status(self.trace.StatusCode.ERROR))
        span.end(end_time=now)

    def on_acquired(self, sender: Any = None, key: Any = None, lease: Any = None, **_: Any) -> None:
        attributes = self._attributes(sender, key, "granted")
        if lease is not None:
            attributes["taskguard.lock.token"] = lease.token
        self._record("acquired", attributes)

    def on_conflict(
        self,
        sender: Any = None,
        key: Any = None,
        holder: Any = None,
        action: Any = None,
        waited: float | None = None,
        **_: Any,
    ) -> None:
        attributes = self._attributes(sender, key, "refused")
        attributes.setdefault("taskguard.lock.strategy", str(action))
        if holder is not None:
            attributes["taskguard.lock.holder.task_id"] = str(holder.task_id)
            attributes["taskguard.lock.holder.host"] = str(holder.holder.hostname)
            attributes["taskguard.lock.holder.token"] = holder.token
        if waited is not None:
            attributes["error.type"] = "timeout"
        self._record("refused", attributes, waited)

    def on_released(
        self,
        sender: Any = None,
        key: Any = None,
        lease: Any = None,
        released: bool = True,
        **_: Any,
    ) -> None:
        attributes = self._attributes(sender, key, "released" if released else "expired")
        if lease is not None:
            attributes["taskguard.lock.token"] = lease.token
        self._record("released", attributes)

    def on_lost(self, sender: Any = None, key: Any = None, lease: Any = None, **_: Any) -> None:
        attributes = self._attributes(sender, key, "lost")
        attributes["error.type"] = "taskguard.LeaseLost"
        if lease is not None:
            attributes["taskguard.lock.token"] = lease.token
        self._record("lost", attributes)


def instrument(*, tracer_provider: Any = None, record_keys: bool = False) -> None:
    """Record taskguard's lock events with OpenTelemetry (``tracer_provider``: default
    the global one). ``record_keys=True`` adds ``taskguard.lock.key`` (off by default:
    keys can be many and can carry data). Call again to change the settings. Raises
    :class:`ConfigurationError` when opentelemetry-api is not installed."""
    with _lock:
        recorder = _Recorder(tracer_provider, record_keys)
        _disconnect()
        recorder.connect()
        _state["recorder"] = recorder


def uninstrument() -> None:
    """Disconnect the receivers (tests, reconfiguration)."""
    with _lock:
        _disconnect()


def _disconnect() -> None:
    current = _state.pop("recorder", None)
    if current is not None:
        current.disconnect()
