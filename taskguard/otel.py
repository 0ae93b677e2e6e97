"""OpenTelemetry for taskguard (optional: ``pip install 'taskguard-sql[otel]'``).

:func:`instrument` wraps the places where every lease operation happens, whichever
integration asks for it (:class:`~taskguard.TaskGuard`'s ``take``/``try_acquire``,
its wait, ``adopt``/``take_over``, ``give_back``/``release``, ``renew`` and
``force_release``), so each becomes a timed span, a child of the span current at
the call: a Celery run's ``run/<task>`` (opentelemetry-instrumentation-celery), a
django.tasks run's, the publisher's at ``delay()``. A renewal runs on the process's
renewer thread: it is a span (a child of the span current when the lease was
granted) only when it fails, is slow, or is sampled. A lease lost is an event on
that span; a conflict an integration acts on (the ``lock_conflict`` signal), an
event on the current span (docs/tracing.md lists names and attributes).

Nothing is wrapped, and ``opentelemetry`` is not imported, until :func:`instrument`
is called with a tracer provider set: until then a run executes exactly the lines it
would without this module.
"""

from __future__ import annotations

import contextvars
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from taskguard import __version__, signals
from taskguard import guard as guard_module
from taskguard.exceptions import ConfigurationError
from taskguard.fencing import FENCED
from taskguard.guard import TaskGuard
from taskguard.held_lease import active_run
from taskguard.lease import Attempt, Lease, LockInfo
from taskguard.options import Phase

__all__ = ["instrument", "uninstrument"]

log = logging.getLogger("taskguard")

#: TaskGuard's methods wrapped: each is where one lease operation happens. An outer
#: one calling an inner one (try_acquire's ``_attempt`` -> ``take``, ``adopt`` ->
#: ``take_over``) makes one span.
_WRAPPED = ("take", "_attempt", "adopt", "take_over", "give_back", "force_release", "renew")
#: How many granted leases remember their parent span (for renewals and losses).
_REMEMBERED = 10_000

_lock = threading.Lock()
# The process's current instrumentation (a dict, so no `global` statement is needed).
_state: dict[str, Any] = {}
# Set inside a wrapped operation: a wrapped method it calls makes no span of its own.
_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("taskguard_otel", default=False)


def _error_type(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def _holder(info: LockInfo) -> dict[str, Any]:
    """The holder of a refusal, as span attributes (those known)."""
    who = info.holder
    found = {
        "taskguard.lock.holder.task_name": who.task_name,
        "taskguard.lock.holder.task_id": who.task_id,
        "taskguard.lock.holder.host": who.hostname,
        "taskguard.lock.holder.pid": who.pid,
        "taskguard.lock.holder.token": info.token,
    }
    return {name: value for name, value in found.items() if value is not None}


def _phase(args: tuple[Any, ...], kwargs: dict[str, Any], at: int) -> Phase | None:
    """The ``phase`` argument of a wrapped call (``at``: its place after the key)."""
    found = kwargs.get("phase", args[at] if len(args) > at else None)
    return found if isinstance(found, Phase) else None


def _granted(lease: Lease | None, outcome: str, otherwise: str) -> dict[str, Any]:
    if lease is None:
        return {"taskguard.lock.outcome": otherwise}
    return {"taskguard.lock.outcome": outcome, "taskguard.lock.token": lease.token}


class _Tracing:
    """The wrappers and signal receivers of one :func:`instrument` call."""

    def __init__(
        self, provider: Any, record_keys: bool, slow_renewal: float, renewal_sample_rate: float
    ) -> None:
        try:
            from opentelemetry import trace
        except ImportError:
            raise ConfigurationError(
                "taskguard.otel needs opentelemetry-api: pip install 'taskguard-sql[otel]'"
            ) from None
        self.trace = trace
        self.tracer = trace.get_tracer("taskguard", __version__, tracer_provider=provider)
        self.record_keys = record_keys
        self.slow_renewal = slow_renewal
        self.sample_rate = renewal_sample_rate
        # A granted lease's owner id -> the span current when it was granted (a run's)
        # and the attributes of that moment (its run's phase and strategy).
        self.parents: dict[str, tuple[Any, dict[str, Any]]] = {}

    def recording(self, provider: Any) -> bool:
        """Whether ``provider`` (None: the global one) is a real one, not the API's
        stand-in before one is set (nor its no-op)."""
        trace = self.trace
        found = trace.get_tracer_provider() if provider is None else provider
        return not isinstance(found, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))

    # -- spans ------------------------------------------------------------------------

    def attributes(self, key: str, phase: Phase | None = None) -> dict[str, Any]:
        """The key (if asked for), the lock phase the call names (an enqueue's
        ``queue``), and the phase and strategy of the guarded run executing here (an
        integration's run: :func:`taskguard.held_lease.enter_run`) unless the call is
        an enqueue's (a job enqueuing another: not its own lease)."""
        found: dict[str, Any] = {"taskguard.lock.key": key} if self.record_keys else {}
        if phase is not None:
            found["taskguard.lock.phase"] = str(phase)
        run = active_run() if phase is not Phase.QUEUE else None
        if run is not None:
            found["taskguard.lock.phase"] = str(Phase.RUN)
            opts = getattr(run, "opts", None) or getattr(getattr(run, "spec", None), "opts", None)
            if opts is not None:
                found["taskguard.lock.strategy"] = str(opts.conflict)
        return found

    def span(
        self,
        name: str,
        key: str,
        extra: dict[str, Any],
        call: Callable[[], Any],
        describe: Callable[[Any, Any, dict[str, Any]], dict[str, Any]],
        phase: Phase | None = None,
    ) -> Any:
        """``call()`` in a span ``name``; ``describe(result, parent span, attributes
        of the context)``: the attributes its result adds; ``phase``: the call's."""
        if _inside.get():
            return call()
        parent = self.trace.get_current_span()
        found = self.attributes(key, phase)
        token = _inside.set(True)
        try:
            with self.tracer.start_as_current_span(name, attributes={**found, **extra}) as span:
                try:
                    result = call()
                except Exception as exc:
                    span.set_attribute("error.type", _error_type(exc))
                    raise
                span.set_attributes(describe(result, parent, found))
                return result
        finally:
            _inside.reset(token)

    def remember(self, lease: Lease | None, parent: Any, found: dict[str, Any]) -> None:
        """``parent`` is where ``lease``'s renewals and loss are recorded; ``found``,
        the attributes they share with its grant."""
        if lease is None:
            return
        parents = self.parents
        if len(parents) >= _REMEMBERED:  # leases never given back (expired, handed on)
            for stale in list(parents)[: _REMEMBERED // 10]:  # the oldest
                parents.pop(stale, None)
        parents[lease.owner] = (parent, found)

    def of_lease(self, lease: Lease, forget: bool = False) -> tuple[Any, dict[str, Any]]:
        """The span ``lease`` was granted under (None: not known) and the attributes
        of its grant (the key's alone if not known)."""
        found = self.parents.pop(lease.owner, None) if forget else self.parents.get(lease.owner)
        return found or (None, self.attributes(lease.key))

    def acquired(self, attempt: Attempt, parent: Any, found: dict[str, Any]) -> dict[str, Any]:
        lease, holder = attempt
        self.remember(lease, parent, found)
        granted = _granted(lease, "granted", "refused")
        return granted if holder is None else {**granted, **_holder(holder)}

    def adopted(self, lease: Lease | None, parent: Any, found: dict[str, Any]) -> dict[str, Any]:
        self.remember(lease, parent, found)
        return _granted(lease, "adopted", "lapsed")

    def released(self, lease: Lease) -> Callable[[bool, Any, Any], dict[str, Any]]:
        def describe(ended: bool, _parent: Any, _found: Any) -> dict[str, Any]:
            granted = self.of_lease(lease, forget=True)[1]  # its run's, if released outside
            outcome = "released" if ended else "expired"
            return {
                **granted,
                "taskguard.lock.outcome": outcome,
                "taskguard.lock.token": lease.token,
            }

        return describe

    def renewal(self, lease: Lease, started: int, ended: bool | None, error: str | None) -> None:
        """A renewal's span, made once it is known to be worth recording (``ended``:
        renew()'s answer; None: it raised ``error``)."""
        took = (time.time_ns() - started) / 1e9
        if ended and took < self.slow_renewal and random.random() >= self.sample_rate:
            return
        parent, granted = self.of_lease(lease)
        context = self.trace.set_span_in_context(parent) if parent is not None else None
        found = {**granted, "taskguard.lock.token": lease.token}
        if error is None:
            found["taskguard.lock.outcome"] = "renewed" if ended else "lost"
        if not ended:
            found["error.type"] = error or "taskguard.exceptions.LeaseLost"
        span = self.tracer.start_span(
            "taskguard.renew", context=context, start_time=started, attributes=found
        )
        if not ended:
            span.set_status(self.trace.Status(self.trace.StatusCode.ERROR))
        span.end()

    # -- the wrappers -----------------------------------------------------------------

    def wrappers(self, originals: dict[str, Any]) -> dict[str, Any]:
        """A wrapper for each of :data:`_WRAPPED`, calling its original."""
        take, attempt, adopt, take_over, give_back, force_release, renew = (
            originals[name] for name in _WRAPPED
        )
        limit_1 = {"taskguard.lock.limit": 1}

        def take_(guard: TaskGuard, key: str, *args: Any, **kwargs: Any) -> Any:
            # take(key, seconds, holder, unless, record_refusal, slot, phase, ...)
            run = lambda: take(guard, key, *args, **kwargs)  # noqa: E731
            phase = _phase(args, kwargs, 5)
            return self.span("taskguard.acquire", key, limit_1, run, self.acquired, phase)

        def attempt_(guard: TaskGuard, key: str, ttl: Any, *details: Any) -> Any:
            # _attempt(key, ttl, task_name, task_id, hostname, pid, slot, limit, min_hold,
            # wait, unless, record_refusal, phase)
            extra = {"taskguard.lock.limit": details[5]}
            run = lambda: attempt(guard, key, ttl, *details)  # noqa: E731
            phase = _phase(details, {}, 10)
            return self.span("taskguard.acquire", key, extra, run, self.acquired, phase)

        def adopt_(guard: TaskGuard, key: str, *args: Any, **kwargs: Any) -> Any:
            run = lambda: adopt(guard, key, *args, **kwargs)  # noqa: E731
            phase = _phase((), kwargs, 0)
            return self.span("taskguard.adopt", key, {}, run, self.adopted, phase)

        def take_over_(guard: TaskGuard, key: str, *args: Any, **kwargs: Any) -> Any:
            # take_over(key, owner, seconds, holder, slot, min_hold, phase)
            run = lambda: take_over(guard, key, *args, **kwargs)  # noqa: E731
            phase = _phase(args, kwargs, 5)
            return self.span("taskguard.adopt", key, {}, run, self.adopted, phase)

        def give_back_(guard: TaskGuard, lease: Lease, *args: Any, **kwargs: Any) -> Any:
            fenced = FENCED.get(lease.owner)
            if fenced is not None and fenced.waits(lease):
                # Put off to the end of the transaction that fenced it: that release,
                # through this wrapper again, is its one span.
                return give_back(guard, lease, *args, **kwargs)
            run = lambda: give_back(guard, lease, *args, **kwargs)  # noqa: E731
            return self.span("taskguard.release", lease.key, {}, run, self.released(lease))

        def force_release_(guard: TaskGuard, key: str, *args: Any, **kwargs: Any) -> Any:
            def describe(ended: bool, _parent: Any, _found: Any) -> dict[str, Any]:
                return {"taskguard.lock.outcome": "released" if ended else "not_held"}

            run = lambda: force_release(guard, key, *args, **kwargs)  # noqa: E731
            return self.span("taskguard.force_release", key, {}, run, describe)

        def renew_(guard: TaskGuard, lease: Lease, *args: Any, **kwargs: Any) -> Any:
            started = time.time_ns()
            try:
                ended = renew(guard, lease, *args, **kwargs)
            except Exception as exc:
                self.renewal(lease, started, None, _error_type(exc))
                raise
            self.renewal(lease, started, ended, None)
            return ended

        made = (take_, attempt_, adopt_, take_over_, give_back_, force_release_, renew_)
        for name, wrapper in zip(_WRAPPED, made, strict=True):
            wrapper.__name__ = wrapper.__qualname__ = name
            wrapper.__doc__ = originals[name].__doc__
        return dict(zip(_WRAPPED, made, strict=True))

    def waiting(self, wait_for: Callable[..., Lease | None]) -> Callable[..., Lease | None]:
        """``acquire(..., wait=)``'s wait, a span inside the acquire's."""

        def wait_for_(
            store: Any, attempt: Any, key: str, owner: str, slots: range, timeout: float,
            settled: Callable[[], bool] | None = None,
        ) -> Lease | None:  # fmt: skip
            seconds = {"taskguard.lock.wait_timeout": timeout}
            with self.tracer.start_as_current_span("taskguard.wait", attributes=seconds) as span:
                ends = time.monotonic() + timeout
                lease = wait_for(store, attempt, key, owner, slots, timeout, settled)
                # Ended early without the lease: refused for good (settled), not timed out.
                gave_up = "timeout" if time.monotonic() >= ends else "refused"
                span.set_attributes(_granted(lease, "granted", gave_up))
                if lease is None and gave_up == "timeout":
                    span.set_attribute("error.type", "timeout")
                    span.set_status(self.trace.Status(self.trace.StatusCode.ERROR))
                return lease

        return wait_for_

    # -- events the integrations send -------------------------------------------------

    def on_conflict(
        self, sender: Any = None, key: Any = None, action: Any = None, **kwargs: Any
    ) -> None:
        """What the integration does about a refusal: an event on the current span (a
        run's, the publisher's: the refused acquire's span is its child)."""
        current = self.trace.get_current_span()
        if current.is_recording():
            found = self.attributes(str(key))
            found.setdefault("taskguard.lock.phase", str(Phase.QUEUE))  # outside a run: at enqueue
            found["taskguard.lock.strategy"] = str(action)
            current.add_event("taskguard.lock.conflict", found)

    def on_lost(
        self, sender: Any = None, key: Any = None, lease: Any = None, **kwargs: Any
    ) -> None:
        """A lease lost: an event on the span it was granted under (the run's)."""
        if not isinstance(lease, Lease):
            return
        parent, granted = self.of_lease(lease, forget=True)
        found = {
            **granted,
            "error.type": "taskguard.exceptions.LeaseLost",
            "taskguard.lock.reason": str(kwargs.get("reason")),
            "taskguard.lock.token": lease.token,
        }
        if parent is not None and parent.is_recording():
            parent.add_event("taskguard.lock.lost", found)
            return
        context = self.trace.set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span("taskguard.lease_lost", context=context, attributes=found)
        span.set_status(self.trace.Status(self.trace.StatusCode.ERROR))
        span.end()

    def receivers(self) -> list[tuple[Any, Any, str]]:
        return [
            (signals.lock_conflict, self.on_conflict, "conflict"),
            (signals.lease_lost, self.on_lost, "lost"),
        ]


def instrument(
    *,
    tracer_provider: Any = None,
    record_keys: bool = False,
    slow_renewal: float = 1.0,
    renewal_sample_rate: float = 0.0,
) -> bool:
    """Trace taskguard's lease operations with OpenTelemetry (``tracer_provider``:
    default the global one). ``record_keys=True`` adds ``taskguard.lock.key`` (off by
    default: keys can be many and can carry data). A renewal is a span when it fails,
    takes ``slow_renewal`` seconds or more, or is among ``renewal_sample_rate`` (0 to
    1) of the others. Call again to change the settings.

    Returns ``False`` (and logs a warning) when there is no tracer provider to record
    with (none given, and no global one set yet): then nothing is wrapped, so it
    costs nothing; call it after setting one. Raises :class:`ConfigurationError`
    when opentelemetry-api is not installed."""
    if not 0.0 <= renewal_sample_rate <= 1.0:
        raise ValueError(f"renewal_sample_rate must be from 0 to 1, got {renewal_sample_rate!r}")
    if not slow_renewal > 0:
        raise ValueError(f"slow_renewal must be a positive number of seconds, got {slow_renewal!r}")
    tracing = _Tracing(tracer_provider, record_keys, float(slow_renewal), renewal_sample_rate)
    with _lock:
        _restore()
        if not tracing.recording(tracer_provider):
            log.warning(
                "taskguard.otel.instrument(): no tracer provider is set, so nothing is "
                "traced; call it after setting one (or pass tracer_provider=)"
            )
            return False
        originals = {name: TaskGuard.__dict__[name] for name in _WRAPPED}
        names = vars(guard_module)  # guard.py's own reference to waiting.wait_for
        _state.update(originals=originals, wait_for=names["wait_for"], tracing=tracing)
        for name, wrapper in tracing.wrappers(originals).items():
            setattr(TaskGuard, name, wrapper)
        names["wait_for"] = tracing.waiting(names["wait_for"])
        for signal, receiver, name in tracing.receivers():
            signal.connect(receiver, weak=False, dispatch_uid=f"taskguard.otel.{name}")
    return True


def uninstrument() -> None:
    """Undo :func:`instrument` (tests, reconfiguration)."""
    with _lock:
        _restore()


def _restore() -> None:
    tracing = _state.pop("tracing", None)
    if tracing is None:
        return
    for name, original in _state.pop("originals").items():
        setattr(TaskGuard, name, original)
    vars(guard_module)["wait_for"] = _state.pop("wait_for")
    for signal, _receiver, name in tracing.receivers():
        signal.disconnect(dispatch_uid=f"taskguard.otel.{name}")
