"""An embedded Celery setup for the demo: broker, result backend, and a real
worker started inside the demo's own process.

By default everything lives in SQLite files in one directory: kombu's SQLAlchemy
transport (``sqla+sqlite:///…``) as the broker and Celery's database result
backend (``db+sqlite:///…``). Any other broker or backend URL works the same way.

The worker is Celery's own :class:`~celery.worker.WorkController` with the
``threads`` pool: it consumes from the broker, runs the tracer and stores results
exactly as ``celery worker -P threads`` would; only the process is shared.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery
from celery.platforms import EX_OK
from celery.worker import WorkController
from celery.worker import state as worker_state
from kombu import entity as _kombu_entity

from taskguard.exceptions import ConfigurationError

__all__ = ["InProcessWorker", "embedded_urls", "make_app", "require_transports"]

log = logging.getLogger("taskguard.demo")

# kombu's entities are untyped; used only for best-effort cleanup.
_Exchange: Any = _kombu_entity.Exchange
_Queue: Any = _kombu_entity.Queue


class BrokerUnavailable(ConfigurationError):
    """The broker or result backend could not be reached."""


def embedded_urls(workdir: Path) -> dict[str, str]:
    """SQLite URLs inside ``workdir`` for the lock database, broker and results."""
    base = workdir.resolve()
    return {
        "database_url": f"sqlite:///{base / 'locks.sqlite'}",
        "broker": f"sqla+sqlite:///{base / 'broker.sqlite'}",
        "result_backend": f"db+sqlite:///{base / 'results.sqlite'}",
    }


def make_app(*, broker: str, result_backend: str, database_url: str, queue: str) -> Celery:
    """A Celery app for the demo. Its tasks go to ``queue`` only, so a shared broker
    (RabbitMQ, Redis) never mixes this run's messages with anyone else's."""
    app = Celery("taskguard_demo", broker=broker, backend=result_backend, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        taskguard_database_url=database_url,
        # Nothing but the demo's own queue: no remote control, events or gossip.
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=3,
        broker_connection_timeout=5,
        task_publish_retry_policy={"max_retries": 3, "interval_start": 0.2},
        # A shared result backend (e.g. Redis) drops the demo's results after an hour.
        result_expires=3600,
        result_extended=False,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
    )
    return app


#: URL scheme -> what installs the modules its kombu transport or Celery backend imports.
_EXTRAS = {
    "redis": "pip install 'taskguard-sql[redis]'",
    "rediss": "pip install 'taskguard-sql[redis]'",
    "sentinel": "pip install 'taskguard-sql[redis]'",
}


def require_transports(app: Celery) -> None:
    """Import the broker's transport and the result backend now: a missing module
    becomes one line naming what to install, not a traceback mid-run."""
    loads: tuple[tuple[str, Callable[[], object]], ...] = (
        ("broker", lambda: app.connection_for_write().transport),
        ("result backend", lambda: app.backend),
    )
    for role, load in loads:
        try:
            load()
        except ImportError as exc:
            url = app.conf.broker_url if role == "broker" else app.conf.result_backend
            scheme = str(url).split(":", 1)[0].split("+", 1)[0]
            fix = _EXTRAS.get(scheme, f"pip install 'celery[{scheme}]'")
            raise ConfigurationError(
                f"the {scheme}:// {role} needs modules that are not installed ({exc}): {fix}"
            ) from None


def check_connections(app: Celery, timeout: float = 10.0) -> None:
    """Fail fast, with the URL named, if the broker or result backend is down."""
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=2, interval_start=0.2, timeout=timeout)
    except Exception as exc:
        url = app.connection_for_write().as_uri()
        raise BrokerUnavailable(f"broker {url} unreachable: {_first_line(exc)}") from None
    try:
        app.backend.get_task_meta("taskguard-demo-startup-check")
    except Exception as exc:
        raise BrokerUnavailable(
            f"result backend {app.backend.as_uri()} unreachable: {_first_line(exc)}"
        ) from None


def delete_queue(app: Celery, queue: str) -> None:
    """Remove the run's queue, its exchange and bindings from a shared broker (best
    effort). Declared first so the channel knows which bindings to remove."""
    try:
        with app.connection_for_write() as conn:
            bound = _Queue(queue, _Exchange(queue, type="direct"), routing_key=queue)(
                conn.default_channel
            )
            bound.declare()
            bound.delete()
            bound.exchange.delete()
    except Exception as exc:
        log.info("could not delete demo queue %s: %s", queue, _first_line(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Controller(WorkController):  # type: ignore[misc]
    """A WorkController that says when its consumer is ready."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.consuming = threading.Event()
        super().__init__(*args, **kwargs)

    def on_consumer_ready(self, consumer: Any) -> None:
        self.consuming.set()


class InProcessWorker:
    """A real Celery worker (``threads`` pool) running in a thread of this process.

    ``with InProcessWorker(app, concurrency=8) as worker:`` returns once the worker
    consumes from the broker, and stops it (warm shutdown) on exit.
    """

    def __init__(self, app: Celery, *, concurrency: int = 8, hostname: str | None = None) -> None:
        self.app = app
        self.concurrency = concurrency
        self.hostname = hostname or "taskguard-demo@%h"
        self._controller: _Controller | None = None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def start(self, timeout: float = 20.0) -> None:
        app = self.app
        app.finalize()
        # The threads pool resolves the app through current_app in its own threads,
        # which falls back to the *default* app: make ours that default.
        app.set_current()
        app.set_default()
        self._controller = _Controller(
            app=app,
            pool="threads",
            concurrency=self.concurrency,
            hostname=self.hostname,
            without_heartbeat=True,
            without_mingle=True,
            without_gossip=True,
            # The blocking loop drains with a 2s timeout, so a shutdown request is
            # seen promptly; the event loop can sleep ~10s when the broker is idle.
            use_eventloop=False,
        )
        self._thread = threading.Thread(target=self._run, name="taskguard-demo-worker", daemon=True)
        self._thread.start()
        if not self._controller.consuming.wait(timeout) or self._failure is not None:
            reason = _first_line(self._failure) if self._failure else f"not ready in {timeout}s"
            self.stop()
            raise BrokerUnavailable(f"the in-process Celery worker did not start: {reason}")

    def _run(self) -> None:
        assert self._controller is not None
        try:
            self._controller.start()
        except BaseException as exc:  # reported by start(); the thread just ends
            self._failure = exc
            self._controller.consuming.set()

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown: running tasks finish, then the consumer and pool stop.

        Like a worker's own signal handlers, this only raises the shutdown flag;
        the worker's thread sees it within a loop cycle and shuts down itself
        (calling ``stop()`` from another thread can block on the broker socket).
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return
        worker_state.should_stop = EX_OK
        try:
            thread.join(timeout)
        finally:
            worker_state.should_stop = None
        if thread.is_alive():
            log.warning("the in-process worker did not stop within %.0fs", timeout)

    def __enter__(self) -> InProcessWorker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
