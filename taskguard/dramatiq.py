"""taskguard for Dramatiq: ``broker.add_middleware(TaskGuardMiddleware())``, then
taskguard's options as actor options (``@dramatiq.actor(key="feed:{url}", ttl=60)``).
Users: docs/dramatiq.md.

An adapter over the core (taskguard.runs): the options are checked by
``GuardSpec.of`` when an actor is declared; a send of a queue-locked actor goes
through ``enqueue_locked``; a worker's run is one ``GuardedRun`` (``start`` in
``before_process_message``, ``exit`` in ``after_process_message``; a message skipped
before its run, by ``AgeLimit``, ``abandon``s the lease its send took). What a conflict
does is the core's; this module only says how Dramatiq skips (``SkipMessage``),
retries (its ``Retries`` middleware, with ``Retry(delay=...)``) and answers a
duplicate send (the queued message).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from dramatiq import Message, Retry
from dramatiq.middleware import Middleware, MiddlewareError, SkipMessage

from taskguard.config import unknown_settings
from taskguard.exceptions import AlreadyLocked, ConfigurationError
from taskguard.options import OPTION_NAMES, Conflict, Framework
from taskguard.runs import Actions, GuardedRun, GuardSpec, enqueue_locked

__all__ = ["TaskGuardMiddleware"]

#: What Dramatiq cannot honour (the core refuses it at declaration, naming Dramatiq).
DRAMATIQ = Framework(
    "Dramatiq",
    frozenset({"rate", "coalesce_replace", "debounce", "debounce_max", Conflict.COALESCE}),
)
#: The message option that says a message went through its queue lock already (a
#: retry or a delayed message coming due is published again as it is).
QUEUED = "taskguard_queued"


#: Each error class, also a MiddlewareError (Dramatiq's before_* hooks log and
#: swallow anything else).
_PASSING: dict[type[BaseException], type[BaseException]] = {}


def _through(error: BaseException) -> BaseException:
    """``error`` itself, made a MiddlewareError too, so that a before_* hook raises it."""
    kind = type(error)
    if not isinstance(error, MiddlewareError):
        if kind not in _PASSING:
            _PASSING[kind] = type(
                kind.__name__, (kind, MiddlewareError), {"__module__": kind.__module__}
            )
        error.__class__ = _PASSING[kind]
    return error


class _SendActions(Actions):
    """A duplicate send: skipped (the marker instead of a Message), answered with the
    queued message, or published again in ``countdown`` seconds (its lock is taken
    when it comes due)."""

    def __init__(self, message: Message[Any], publish: Any) -> None:
        self.message, self.publish = message, publish

    def existing(self, job_id: str) -> Any:
        return self.message.copy(message_id=job_id)

    def retry(self, countdown: float, error: AlreadyLocked) -> Any:
        return self.publish(self.message, delay=max(1, round(countdown * 1000)))


class _RunActions(Actions):
    """A busy key at the start of a run: skipped, or retried by Dramatiq's Retries."""

    def retry(self, countdown: float, error: AlreadyLocked) -> Any:
        raise _through(Retry(str(error), delay=max(1, round(countdown * 1000))))


#: A worker's run of a message: retried by Dramatiq's Retries; a message may be
#: delivered again after it finished (its finished record drops the copy).
_dramatiq_run = functools.partial(GuardedRun, actions=_RunActions(), redelivers=True)


class TaskGuardMiddleware(Middleware):
    """taskguard's locks for a Dramatiq broker. ``database_url``: the lock database
    (else ``$TASKGUARD_DATABASE_URL``); ``settings``: other ``taskguard_*`` settings
    without the prefix (``history=True``, ``default_ttl=60``, ...). Add it before
    declaring actors."""

    def __init__(self, database_url: str | None = None, **settings: Any) -> None:
        #: The settings, read by taskguard.config as an app's ``conf``.
        self.conf = {"taskguard_database_url": database_url}
        self.conf.update({f"taskguard_{name}": value for name, value in settings.items()})
        if unknown := unknown_settings(self):
            raise ConfigurationError(f"TaskGuardMiddleware: {unknown[0]}")
        self.specs: dict[str, GuardSpec] = {}
        self._runs = threading.local()

    @property
    def actor_options(self) -> set[str]:
        return set(OPTION_NAMES)

    def before_declare_actor(self, broker: Any, actor: Any) -> None:
        options = {name: actor.options[name] for name in OPTION_NAMES if name in actor.options}
        self.specs.pop(actor.actor_name, None)
        if not options:
            return
        try:
            spec = GuardSpec.of(actor.fn, DRAMATIQ, options, name=actor.actor_name)
        except ConfigurationError as exc:
            raise _through(exc) from None
        self.specs[actor.actor_name] = spec
        if spec.opts.locks_queue and not hasattr(broker.enqueue, "taskguard"):
            broker.enqueue = self._enqueuing(broker.enqueue)

    def _enqueuing(self, publish: Any) -> Any:
        """The broker's ``enqueue`` taking a queue-locked actor's key first (Dramatiq's
        ``before_enqueue`` can neither answer a send nor see its publish fail)."""

        @functools.wraps(publish)
        def enqueue(message: Message[Any], *, delay: int | None = None) -> Any:
            spec = self.specs.get(message.actor_name)
            if spec is None or not spec.opts.locks_queue or QUEUED in message.options:
                return publish(message, delay=delay)
            marked = message.copy(options={QUEUED: True})
            return enqueue_locked(
                spec, self, message.args, message.kwargs,
                publish=lambda: publish(marked, delay=delay),
                job_id=lambda sent: sent.message_id,
                actions=_SendActions(message, publish), task_id=message.message_id,
            )  # fmt: skip

        enqueue.taskguard = True  # type: ignore[attr-defined]
        return enqueue

    def before_process_message(self, broker: Any, message: Any) -> None:
        spec = self.specs.get(message.actor_name)
        if spec is None:
            return
        run = _dramatiq_run(spec, self, message.args, message.kwargs, task_id=message.message_id)
        self._runs.current = run  # from now on, the after_* hooks end it
        try:
            began = run.start()
        except Exception as exc:  # Retry, AlreadyLocked (on_conflict="raise"), an outage
            _through(exc)
            raise
        if not began:  # skipped (the core logged the key and its holder)
            raise SkipMessage(run.outcome)

    def after_process_message(
        self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        run, self._runs.current = getattr(self._runs, "current", None), None
        if run is not None:  # a failed message may be retried: no finished record then
            run.exit(final=exception is None)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        spec = self.specs.get(message.actor_name)
        if getattr(self._runs, "current", None) is None and spec is not None:
            # skipped before its run began (AgeLimit): the lease its send took goes back
            _dramatiq_run(
                spec, self, message.args, message.kwargs, task_id=message.message_id
            ).abandon()
        self.after_process_message(broker, message)
