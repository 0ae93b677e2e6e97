"""@guarded_task definition, configuration errors, and what goes into the message
(read back from Celery's in-memory transport, not mocked)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from taskguard import (
    ConfigurationError,
    GuardedTask,
    InvalidArgument,
    TaskGuard,
    guarded_task,
    is_skipped,
)
from taskguard.celery.message import HEADER, Handed, Header
from taskguard.config import ENV_DATABASE_URL, reset_guards


@pytest.fixture
def memory_app(pg_url: str) -> Iterator[Celery]:
    """A non-eager app publishing to the in-process memory transport."""
    app = Celery("tg_opts", broker="memory://", set_as_current=False)
    app.conf.update(task_default_queue=f"q-{uuid.uuid4().hex[:8]}", taskguard_database_url=pg_url)
    yield app
    reset_guards()


def published(app: Celery) -> Any:
    """The next message on the app's default queue."""
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        message = queue.get(timeout=5)
        message.ack()
        queue.close()
        return message


def test_the_key_travels_in_the_message_header(memory_app: Celery) -> None:
    calls: list[str] = []

    def key(url: str) -> str:
        calls.append(url)
        return f"feed:{url}"

    @guarded_task(app=memory_app, shared=False, key=key)
    def fetch(url: str) -> None: ...

    fetch.apply_async(("a",), headers={"mine": 1})
    message = published(memory_app)
    assert message.headers[HEADER] == "feed:a"  # the key alone: a plain header
    assert message.headers["mine"] == 1  # the caller's headers are kept
    assert calls == ["a"]


def test_queue_phase_publishes_the_lease_it_took(memory_app: Celery, pg_url: str) -> None:
    @guarded_task(app=memory_app, shared=False, key="q", ttl=5, queue_ttl=20, lock="queue")
    def job() -> None: ...

    result = job.apply_async(countdown=10)
    header = published(memory_app).headers[HEADER]
    guard = TaskGuard(pg_url)
    try:
        info = guard.get("q")
        assert info is not None and info.held
        handed = Header.of_string(header).lease
        assert handed is not None and Handed.of(handed).owner == info.owner
        assert info.holder.task_id == result.id
        # the lease covers the countdown plus the queue ttl
        assert 20 < info.expires_in.total_seconds() <= 30
        value = job.apply_async().get()  # conflict at enqueue: nothing published
        assert is_skipped(value) and value["holder"]["task_id"] == result.id
    finally:
        guard.dispose()


def test_bare_decorator_is_a_shared_task(pg_url: str) -> None:
    @guarded_task
    def bare_guarded_job(x: int) -> int:
        return x

    app = Celery("tg_bare", set_as_current=False)
    app.conf.update(task_always_eager=True, taskguard_database_url=pg_url)
    try:
        task = app.tasks[f"{__name__}.bare_guarded_job"]
        assert isinstance(task, GuardedTask)
        assert task.apply((3,)).get() == 3
    finally:
        reset_guards()


def test_app_task_with_base_and_taskguard_options(pg_url: str) -> None:
    app = Celery("tg_base", set_as_current=False)
    app.conf.update(task_always_eager=True, taskguard_database_url=pg_url)

    @app.task(base=GuardedTask, taskguard_key=lambda n: f"n:{n}", taskguard_ttl=5, shared=False)
    def job(n: int) -> int:
        return n

    try:
        assert job.taskguard_key_for((4,)) == "n:4"  # a function stays a plain callable
        assert job.delay(4).get() == 4
    finally:
        reset_guards()


def test_bad_options_fail_at_definition() -> None:
    with pytest.raises(ConfigurationError, match=r"tasks\.f: key template 'x:\{y\}' refers to 'y'"):

        @guarded_task(name="tasks.f", key="x:{y}")
        def f(x: int) -> None: ...

    with pytest.raises(ConfigurationError, match="on_conflict='existing'"):

        @guarded_task(on_conflict="existing")
        def g() -> None: ...

    with pytest.raises(ConfigurationError, match="must derive from GuardedTask"):

        @guarded_task(base=object)
        def h() -> None: ...


def test_bind_true_tasks_key_on_their_own_arguments(pg_url: str) -> None:
    app = Celery("tg_bind", set_as_current=False)
    app.conf.update(task_always_eager=True, taskguard_database_url=pg_url)

    @guarded_task(app=app, shared=False, bind=True, key="b:{n}")
    def job(self: Any, n: int) -> str:
        return str(self.request.id)

    try:
        assert job.taskguard_key_for((1,)) == "b:1"
        assert job.delay(1).get()
    finally:
        reset_guards()


def test_missing_database_url_is_a_clear_error_at_first_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_DATABASE_URL, raising=False)
    app = Celery("tg_noconf", set_as_current=False)
    app.conf.update(task_always_eager=True)

    @guarded_task(app=app, shared=False)
    def run_phase() -> None: ...

    @guarded_task(app=app, shared=False, lock="queue")
    def queue_phase() -> None: ...

    result = run_phase.delay()  # defining and publishing a run-phase task needs no database
    assert result.state == "FAILURE" and isinstance(result.result, ConfigurationError)
    assert "taskguard_database_url" in str(result.result)
    assert ENV_DATABASE_URL in str(result.result)
    with pytest.raises(ConfigurationError, match="taskguard_database_url"):
        queue_phase.delay()


def test_database_url_from_the_environment(monkeypatch: pytest.MonkeyPatch, pg_url: str) -> None:
    monkeypatch.setenv(ENV_DATABASE_URL, pg_url)
    app = Celery("tg_env", set_as_current=False)
    app.conf.update(task_always_eager=True)

    @guarded_task(app=app, shared=False)
    def job() -> str:
        return "ok"

    try:
        assert job.delay().get() == "ok"
    finally:
        reset_guards()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"limit": 0}, r"tasks\.lim: limit must be an int from 1 to 1000, got 0"),
        ({"limit": 1001}, "limit must be an int from 1 to 1000, got 1001"),
        ({"limit": True}, "limit must be an int from 1 to 1000, got True"),
        ({"limit": 2.0}, "limit must be an int from 1 to 1000, got 2.0"),
        ({"min_hold": -1}, r"tasks\.lim: .*min_hold"),
        ({"min_hold": "soon"}, "min_hold"),
        ({"on_conflict": "wait", "wait_timeout": 0}, "wait_timeout"),
        ({"wait_timeout": 5}, "wait_timeout applies to on_conflict='wait' only"),
        ({"on_conflict": "wait", "lock": "queue"}, "on_conflict='wait'.*needs lock='run'"),
        ({"on_conflict": "wait", "lock": "queue_and_run"}, "publishers never block"),
    ],
)
def test_bad_limit_min_hold_and_wait_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):

        @guarded_task(name="tasks.lim", **options)
        def lim() -> None: ...


def test_limit_min_hold_and_wait_options_are_kept(pg_url: str) -> None:
    app = Celery("tg_opts", broker="memory://", set_as_current=False)
    app.conf.taskguard_database_url = pg_url

    @guarded_task(app=app, shared=False, limit=3, min_hold=2, on_conflict="wait", wait_timeout=9)
    def job() -> None: ...

    opts = job.taskguard_options
    assert (opts.limit, opts.min_hold, opts.wait_timeout) == (3, 2.0, 9.0)
    assert opts.acquire_options == {"limit": 3, "min_hold": 2.0}

    @guarded_task(app=app, shared=False)
    def plain() -> None: ...

    assert plain.taskguard_options.acquire_options == {}

    @app.task(base=GuardedTask, shared=False, taskguard_limit=0)
    def via_base() -> None: ...

    with pytest.raises(ConfigurationError, match="limit must be an int"):
        via_base.taskguard_options  # noqa: B018


# -- misspelled options, key callables, is_skipped(AsyncResult) (issue 27) ----------------


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"tll": 60}, "unknown option tll=60: did you mean ttl= (a taskguard option)?"),
        ({"on_confict": "skip"}, "did you mean on_conflict= (a taskguard option)?"),
        ({"debouce": 2}, "did you mean debounce= (a taskguard option)?"),
        ({"acks_lat": True}, "did you mean acks_late= (a Celery task option)?"),
        ({"max_retry": 3}, "did you mean max_retries= (a Celery task option)?"),
        ({"autoretyr_for": (KeyError,)}, "did you mean autoretry_for= (a Celery task option)?"),
    ],
)
def test_a_misspelled_option_is_refused_when_the_task_is_declared(
    options: dict[str, Any], said: str
) -> None:
    """``tll=60`` was silently accepted (Celery made it a task attribute)."""
    app = Celery("tg_typo", set_as_current=False)
    with pytest.raises(ConfigurationError) as err:

        @guarded_task(app=app, shared=False, name="feeds.fetch", **options)
        def fetch(url: str) -> None: ...

    assert str(err.value) == f"task feeds.fetch: {said}" or said in str(err.value)
    assert str(err.value).startswith("task feeds.fetch: unknown option ")


def test_celery_options_and_custom_attributes_pass_through() -> None:
    app = Celery("tg_pass", set_as_current=False)
    celery_options: dict[str, Any] = dict(
        bind=True, acks_late=True, max_retries=3, default_retry_delay=5, rate_limit="10/m",
        time_limit=60, soft_time_limit=50, ignore_result=True, track_started=True,
        autoretry_for=(KeyError,), retry_backoff=True, retry_backoff_max=60, retry_jitter=False,
        retry_kwargs={"max_retries": 2}, queue="feeds", routing_key="feeds", priority=5,
        expires=300, serializer="json", typing=False, reject_on_worker_lost=True,
        store_errors_even_if_ignored=True, throws=(KeyError,),
    )  # fmt: skip
    custom = {"owner_team": "ingest", "sla_seconds": 30, "category": "feeds", "x": 1}

    @guarded_task(app=app, shared=False, name="feeds.fetch2", ttl=30, **celery_options, **custom)
    def fetch(self: Any, url: str) -> None: ...

    assert fetch.acks_late is True and fetch.queue == "feeds"
    assert (fetch.owner_team, fetch.sla_seconds, fetch.category) == ("ingest", 30, "feeds")


def test_app_wide_task_settings_reach_guarded_tasks() -> None:
    """Declaring a task must not bind GuardedTask to another (the current) app: that
    fixed acks_late=False on the base class, so task_acks_late and
    task_reject_on_worker_lost were ignored and a killed run's message was lost."""
    from taskguard.celery.task import GuardedTask

    app = Celery("tg_settings", set_as_current=False)
    app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True)

    @guarded_task(app=app, shared=False, name="settings.run", ttl=30)
    def run(x: int) -> None: ...

    assert run.acks_late is True and run.reject_on_worker_lost is True
    assert "acks_late" not in GuardedTask.__dict__ and not GuardedTask.__bound__


def test_a_key_callable_that_cannot_take_the_arguments_fails_at_declaration() -> None:
    app = Celery("tg_keyfn", set_as_current=False)
    with pytest.raises(ConfigurationError) as err:

        @guarded_task(app=app, shared=False, name="feeds.fetch3", key=lambda url: url)
        def fetch(feed_url: str, force: bool = False) -> None: ...

    text = str(err.value)
    assert text.startswith("task feeds.fetch3: key callable <lambda>(url) cannot take")
    assert "the task's arguments (feed_url: " in text and "force: " in text


def test_a_key_callable_that_does_not_fit_a_call_names_the_task(memory_app: Celery) -> None:
    """With *args the fit is known only per call: the error names the task, not a
    raw TypeError; a TypeError raised inside the callable is the user's own."""

    def one(url: str) -> str:
        return f"feed:{url}"

    @guarded_task(app=memory_app, shared=False, name="feeds.any", key=one)
    def fetch(*urls: str) -> None: ...

    fetch.delay("a")  # fits
    with pytest.raises(ConfigurationError, match=r"^task feeds\.any: key callable one\(url"):
        fetch.delay("a", "b")

    def buggy(url: str) -> str:
        raise TypeError("my own bug")

    @guarded_task(app=memory_app, shared=False, name="feeds.buggy", key=buggy)
    def fetch2(url: str) -> None: ...

    with pytest.raises(TypeError, match="my own bug"):
        fetch2.delay("a")


def test_is_skipped_reads_a_finished_async_result(pg_url: str) -> None:
    """``is_skipped(result)`` returned False silently, also after ``.get()``."""
    app = Celery("tg_skip", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        task_store_eager_result=True,
        taskguard_database_url=pg_url,
        result_backend="cache+memory://",
    )

    @guarded_task(app=app, shared=False, key="feed:{url}", ttl=30, lock="queue")
    def fetch(url: str) -> str:
        return url

    guard = TaskGuard(pg_url)
    try:
        held = guard.acquire("feed:a", 30)
        assert held is not None
        skipped = fetch.delay("a")
        assert is_skipped(skipped) and is_skipped(skipped.get())
        guard.release(held)
        ran = fetch.delay("a")
        assert not is_skipped(ran) and ran.get() == "a"
    finally:
        guard.dispose()
        reset_guards()
    pending = app.AsyncResult("not-finished")
    with pytest.raises(
        InvalidArgument, match=r"has not finished \(state PENDING\).*result\.get\(\)"
    ):
        is_skipped(pending)


def test_is_coalesced_reads_a_finished_async_result_as_is_skipped_does(pg_url: str) -> None:
    """``is_coalesced(t.delay(...))`` was always False (only the value was read)."""
    from taskguard.celery.pending import is_coalesced, pending_key

    app = Celery("tg_coalesced", set_as_current=False)
    app.conf.update(taskguard_database_url=pg_url, result_backend="cache+memory://")

    @guarded_task(
        app=app, shared=False, name="tg.imp", key="feed:{url}", ttl=30, on_conflict="coalesce"
    )
    def imp(url: str) -> str:
        return url

    guard = TaskGuard(pg_url)
    try:
        place = guard.acquire(pending_key("feed:a", "tg.imp"), 30, task_id="the-pending-run")
        assert place is not None
        merged = imp.delay("a")  # merged into the pending run: answered at once
        assert is_coalesced(merged) and is_coalesced(merged.get())
        assert not is_skipped(merged)
    finally:
        guard.dispose()
        reset_guards()
    with pytest.raises(InvalidArgument, match=r"^is_coalesced\(\): .*has not finished"):
        is_coalesced(app.AsyncResult("not-finished"))
