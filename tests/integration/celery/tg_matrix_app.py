"""Celery app of the combination matrix (``celery -A tg_matrix_app worker``).

One guarded task per combination of ``lock=`` and ``on_conflict=`` (and
``debounce=``, ``rate=``, ``limit=`` where they apply), named ``tgm.<case>``, all
on the key ``m:{key_id}``; every run is recorded by ``tg_pending_app.record``
(start and end by PostgreSQL's clock, whichever store holds the locks). Also the
guide's feed pair (``import_feed`` coalescing, ``reindex_feed`` debounced, one
key) and plain ``echo``/``collect`` tasks for canvases.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from tg_pending_app import make_app as make_pending_app
from tg_pending_app import record
from tg_worker_app import visibility_from_environment

from taskguard import guarded_task

#: Seconds each body runs.
BODY = 0.3

#: The valid combinations: case name -> taskguard options.
CONFIGS: dict[str, dict[str, Any]] = {
    "run-skip": {"lock": "run", "on_conflict": "skip"},
    "run-raise": {"lock": "run", "on_conflict": "raise"},
    "run-retry": {"lock": "run", "on_conflict": "retry", "retry_countdown": 0.3},
    "run-wait": {"lock": "run", "on_conflict": "wait", "wait_timeout": 20},
    "run-coalesce": {"lock": "run", "on_conflict": "coalesce"},
    "run-debounce": {"lock": "run", "debounce": 0.5},
    "run-rate": {"lock": "run", "rate": "2/1s", "limit": 4},
    "run-limit": {"lock": "run", "limit": 2},
    "queue-skip": {"lock": "queue", "on_conflict": "skip"},
    "queue-raise": {"lock": "queue", "on_conflict": "raise"},
    "queue-retry": {"lock": "queue", "on_conflict": "retry", "retry_countdown": 0.3},
    "queue-existing": {"lock": "queue", "on_conflict": "existing"},
    "queue-limit": {"lock": "queue", "limit": 2},
    "queue_and_run-skip": {"lock": "queue_and_run", "on_conflict": "skip"},
    "queue_and_run-raise": {"lock": "queue_and_run", "on_conflict": "raise"},
    "queue_and_run-retry": {
        "lock": "queue_and_run",
        "on_conflict": "retry",
        "retry_countdown": 0.3,
    },
    "queue_and_run-existing": {"lock": "queue_and_run", "on_conflict": "existing"},
    "queue_and_run-rate": {"lock": "queue_and_run", "rate": "2/1s", "limit": 4},
    "queue_and_run-limit": {"lock": "queue_and_run", "limit": 2},
}

#: Combinations refused when the task is declared.
INVALID: dict[str, dict[str, Any]] = {
    "run-existing": {"lock": "run", "on_conflict": "existing"},
    "queue-wait": {"lock": "queue", "on_conflict": "wait"},
    "queue-coalesce": {"lock": "queue", "on_conflict": "coalesce"},
    "queue-debounce": {"lock": "queue", "debounce": 1},
    "queue-rate": {"lock": "queue", "rate": "2/1s"},
    "queue_and_run-wait": {"lock": "queue_and_run", "on_conflict": "wait"},
    "queue_and_run-coalesce": {"lock": "queue_and_run", "on_conflict": "coalesce"},
    "queue_and_run-debounce": {"lock": "queue_and_run", "debounce": 1},
    **{
        f"run-debounce-{strategy}": {"lock": "run", "on_conflict": strategy, "debounce": 1}
        for strategy in ("raise", "retry", "wait", "coalesce")
    },
}


def make_app(
    broker_url: str, result_backend: str | None, queue: str, database_url: str, runs_url: str
) -> Celery:
    """The app (every matrix task registered) for these settings."""
    app = make_pending_app(broker_url, result_backend, queue, database_url, runs_url)
    app.conf.taskguard_history = False  # the default
    visibility_from_environment(app)

    for case, options in CONFIGS.items():
        _register(app, runs_url, case, options)

    @app.task(shared=False, name="tgm.echo")
    def echo(value: Any = None) -> Any:
        return value

    @app.task(shared=False, name="tgm.collect")
    def collect(values: Any) -> Any:
        return values

    # The guide's pair: one key, two tasks, each with its own pending run.
    @guarded_task(
        app=app, shared=False, name="tgm.import_feed", key="feed:{feed_url}", ttl=3,
        on_conflict="coalesce", bind=True,
    )  # fmt: skip
    def import_feed(self: Any, feed_url: str, duration: float = BODY) -> str:
        return record(self, runs_url, feed_url, "import", duration)

    @guarded_task(
        app=app, shared=False, name="tgm.reindex_feed", key="feed:{feed_url}", ttl=3,
        debounce=1, bind=True,
    )  # fmt: skip
    def reindex_feed(self: Any, feed_url: str, changed_ids: Any = ()) -> str:
        return record(self, runs_url, feed_url, "reindex", BODY)

    return app


def _register(app: Celery, runs_url: str, case: str, options: dict[str, Any]) -> None:
    def body(
        self: Any, prev: Any = None, *, key_id: str, note: str = "", duration: float = BODY
    ) -> str:
        # ``prev``: a chain link's previous result (Celery passes it first).
        return record(self, runs_url, key_id, note, duration)

    body.__name__ = "tgm_" + case.replace("-", "_")
    guarded_task(
        app=app, shared=False, name=f"tgm.{case}", key="m:{key_id}", ttl=3, max_retries=100,
        bind=True, **options,
    )(body)  # fmt: skip


app = make_app(
    broker_url=os.environ.get("TASKGUARD_TEST_BROKER_URL", "memory://"),
    result_backend=os.environ.get("TASKGUARD_TEST_RESULT_BACKEND") or None,
    queue=os.environ.get("TASKGUARD_TEST_QUEUE", "tg_matrix_app"),
    database_url=os.environ.get("TASKGUARD_DATABASE_URL", ""),
    runs_url=os.environ.get("TG_RUNS_URL", ""),
)
