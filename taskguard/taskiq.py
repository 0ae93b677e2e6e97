"""taskguard for taskiq: a middleware and task options over the core's guarded run
(taskguard/runs.py). It only translates taskiq's events into the core's calls: the
options are checked by :meth:`GuardSpec.of` (what taskiq cannot honour: :data:`TASKIQ`),
a send with the queue lock is :func:`enqueue_locked`, a run is a :class:`GuardedRun`.

- Options: the ``taskguard`` label (``@broker.task(taskguard={"key": ..., "ttl": 60})``,
  checked when the broker starts) or :func:`guarded` over ``@broker.task`` (checked at once).
- The run: taskiq's middlewares cannot keep a task's body from running, so the task's
  function is wrapped (``task.original_func``): the lease taken (or adopted from the
  send), the body run while the process's renewer renews it, the lease given back.
  Async bodies: every statement on a thread, none on the event loop. Sync bodies: on
  taskiq's thread pool, as taskiq runs them.
- The send (``lock="queue"``/``"queue_and_run"``): ``pre_send`` takes the key and
  publishes the message itself; a duplicate never reaches the broker (skipped: its
  result is the skipped marker; ``existing``: ``kiq`` returns the queued job's handle;
  ``raise``: ``kiq`` raises :class:`~taskguard.AlreadyLocked`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

from taskiq import AsyncBroker, AsyncTaskiqDecoratedTask, TaskiqMessage, TaskiqMiddleware
from taskiq.message import BrokerMessage
from taskiq.result import TaskiqResult

from taskguard.config import DEFAULTS
from taskguard.exceptions import ConfigurationError
from taskguard.options import Conflict, Framework
from taskguard.runs import Actions, GuardedRun, GuardSpec, enqueue_locked

__all__ = ["LABEL", "TASKIQ", "TaskguardMiddleware", "guarded"]

#: The task label that holds a task's options.
LABEL = "taskguard"
#: What taskiq cannot honour (the core refuses it, naming taskiq): start rates and
#: pending runs; ``retry`` (taskiq has no delayed re-send common to its brokers); ``wait``
#: (it would hold one of the event loop's threads, which the lease statements need).
TASKIQ = Framework(
    "taskiq",
    frozenset({
        "rate", "coalesce_replace", "debounce", "debounce_max",
        Conflict.COALESCE, Conflict.RETRY, Conflict.WAIT,
    }),
)  # fmt: skip
#: Set on a message ``pre_send`` published (or answered) itself: the broker's kick drops it.
_SENT = "taskguard_sent"

# The message this context's task runs for (set by pre_execute: its task id).
_message: contextvars.ContextVar[TaskiqMessage | None] = contextvars.ContextVar(
    "taskguard_taskiq_message", default=None
)


class _Answered(Actions):
    # A duplicate send: skipped (its result: the marker), or the queued job's id.
    def skip(self, value: dict[str, Any], error: Exception) -> Any:
        return TaskiqResult(is_err=False, return_value=value, execution_time=0.0)

    def existing(self, job_id: str) -> Any:
        return job_id


class TaskguardMiddleware(TaskiqMiddleware):
    """taskguard on a taskiq broker: ``broker.with_middlewares(TaskguardMiddleware())``.

    ``database_url``: the locks database (default: ``$TASKGUARD_DATABASE_URL``);
    ``settings``: taskguard's settings without their ``taskguard_`` prefix
    (``history=True``, ``default_ttl=600``, ...). Add it last: a send with the queue
    lock is published by this middleware, after the ones before it."""

    def __init__(self, database_url: str | None = None, **settings: Any) -> None:
        super().__init__()
        self.conf = {f"taskguard_{name}": value for name, value in settings.items()}
        unknown = sorted(set(self.conf) - set(DEFAULTS))
        if unknown:
            raise ConfigurationError(f"TaskguardMiddleware: unknown setting {unknown[0][10:]}=")
        self.conf["taskguard_database_url"] = database_url

    def set_broker(self, broker: AsyncBroker) -> None:
        super().set_broker(broker)
        self._kick = kick = broker.kick

        async def kick_unless_sent(message: BrokerMessage) -> None:
            if _SENT not in message.labels:
                await kick(message)

        broker.kick = kick_unless_sent  # type: ignore[method-assign]

    def guard_task(self, task: AsyncTaskiqDecoratedTask[Any, Any], options: Any) -> GuardSpec:
        """Check ``options`` for ``task`` and guard its runs (once)."""
        spec: GuardSpec | None = getattr(task.original_func, "__taskguard__", None)
        if spec is not None:
            return spec
        if not isinstance(options, Mapping):
            raise ConfigurationError(
                f"task {task.task_name}: the {LABEL} label must be a dict of options, "
                f"like {LABEL}={{'key': 'feed:{{url}}'}}"
            )
        spec = GuardSpec.of(task.original_func, TASKIQ, options, name=task.task_name)
        task.original_func = self._wrap(spec, task.original_func)
        return spec

    def _spec(self, task_name: str) -> GuardSpec | None:
        task = self.broker.find_task(task_name)
        if task is None or not (
            LABEL in task.labels or hasattr(task.original_func, "__taskguard__")
        ):
            return None
        return self.guard_task(task, task.labels.get(LABEL))

    async def startup(self) -> None:
        for name in self.broker.get_all_tasks():  # a bad label fails the start
            self._spec(name)

    def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        self._spec(message.task_name)  # a task registered after the start
        _message.set(message)
        return message

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        spec = self._spec(message.task_name)
        if spec is None or not spec.opts.locks_queue:
            return message
        loop, sent = asyncio.get_running_loop(), self.broker.formatter.dumps(message)
        cancelled = threading.Event()

        def publish() -> None:
            if cancelled.is_set():  # kiq cancelled meanwhile: its lease goes back, nothing sent
                raise asyncio.CancelledError
            asyncio.run_coroutine_threadsafe(self._kick(sent), loop).result()

        call = asyncio.ensure_future(asyncio.to_thread(
            enqueue_locked, spec, self, tuple(message.args), message.kwargs, publish,
            job_id=lambda _: message.task_id, actions=_Answered(), task_id=message.task_id,
        ))  # fmt: skip
        try:
            answer = await asyncio.shield(call)
        except asyncio.CancelledError:  # the acquire outlives it: wait for its lease to go back
            cancelled.set()
            await asyncio.wait([call])
            raise
        if isinstance(answer, str):  # the queued job's id: kiq's handle names that job
            message.task_id = answer
        elif isinstance(answer, TaskiqResult):  # skipped: the marker is its result
            await self.broker.result_backend.set_result(message.task_id, answer)
        message.labels[_SENT] = True
        return message

    def _run(self, spec: GuardSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GuardedRun:
        message = _message.get()
        task_id = message.task_id if message is not None else None
        # redelivers: a broker with acks may deliver a finished job again.
        return GuardedRun(spec, self, args, kwargs, task_id=task_id, redelivers=True)

    def _wrap(self, spec: GuardSpec, func: Callable[..., Any]) -> Callable[..., Any]:
        # A failed body leaves no finished record: a retry middleware's copy (same id) runs.
        if inspect.iscoroutinefunction(func):

            async def run_async(*args: Any, **kwargs: Any) -> Any:
                return await self._run(spec, args, kwargs).arun(lambda: func(*args, **kwargs))

            wrapped: Callable[..., Any] = run_async
        else:

            def run_sync(*args: Any, **kwargs: Any) -> Any:
                return self._run(spec, args, kwargs).run(lambda: func(*args, **kwargs))

            wrapped = run_sync
        functools.update_wrapper(wrapped, func)
        wrapped.__taskguard__ = spec  # type: ignore[attr-defined]
        return wrapped


def guarded(
    **options: Any,
) -> Callable[[AsyncTaskiqDecoratedTask[Any, Any]], AsyncTaskiqDecoratedTask[Any, Any]]:
    """Guard a task, its options checked now: put it over ``@broker.task``. The broker
    must have a :class:`TaskguardMiddleware`."""

    def apply(task: AsyncTaskiqDecoratedTask[Any, Any]) -> AsyncTaskiqDecoratedTask[Any, Any]:
        found = [m for m in task.broker.middlewares if isinstance(m, TaskguardMiddleware)]
        if not found:
            raise ConfigurationError(
                f"task {task.task_name}: its broker has no TaskguardMiddleware: "
                "broker.with_middlewares(TaskguardMiddleware())"
            )
        found[0].guard_task(task, options)
        return task

    return apply
