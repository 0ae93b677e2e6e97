"""``taskguard demo``: Celery's "only one at a time" feed importer, end to end.

Many duplicate ``import_feed(feed_url)`` submissions for a handful of feeds are
published concurrently, in waves, to a real worker. Each execution of the task
body records when it started and ended; the final table's "max at once" is
computed from those times, so it reports what happened, not what was intended.
"""

from __future__ import annotations

import logging
import random
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Celery, current_task
from kombu.utils.url import maybe_sanitize_url

from taskguard import current_lease, guarded_task, is_skipped, schema
from taskguard.config import guard_for, reset_guards
from taskguard.demo.embedded import (
    InProcessWorker,
    check_connections,
    delete_queue,
    embedded_urls,
    make_app,
    require_transports,
)
from taskguard.demo.record import RunLog
from taskguard.demo.show import FeedTally, feed_name, locks_table, progress_line, summary_table
from taskguard.display import printable
from taskguard.exceptions import ConfigurationError
from taskguard.urls import mask_url

__all__ = ["DemoOptions", "run_demo"]

#: Feeds the demo imports (URLs under the reserved example.com domain).
FEED_NAMES = ("news", "python", "weather", "sports", "science", "music", "movies", "travel")
KEY_TEMPLATE = "feed:{feed_url}"
TASK_NAME = "taskguard.demo.import_feed"
LOCK_TTL = 60
#: Exit codes, as in the rest of the CLI (2, a setup error, is raised as an exception).
EXIT_OK, EXIT_FAILED = 0, 1
FEED_BASE = "https://example.com/feeds/"


def feed_urls(count: int) -> list[str]:
    """The first ``count`` demo feed URLs."""
    return [f"{FEED_BASE}{name}.rss" for name in FEED_NAMES[:count]]


@dataclass
class DemoOptions:
    """What ``taskguard demo`` runs on and how hard it pushes."""

    database_url: str | None = None
    broker: str | None = None
    result_backend: str | None = None
    workdir: Path | None = None
    feeds: int = 5
    waves: int = 4
    duplicates: int = 6
    concurrency: int = 8
    import_seconds: float = 1.0
    wave_interval: float = 1.5
    #: False runs the same task without taskguard, to show what goes wrong.
    guarded: bool = True
    verbose: bool = False
    #: Seconds to wait for the last results after the last wave was published.
    timeout: float = 15.0

    def validate(self) -> None:
        if not 1 <= self.feeds <= len(FEED_NAMES):
            raise ConfigurationError(f"--feeds must be between 1 and {len(FEED_NAMES)}")
        for name in ("waves", "duplicates", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"--{name} must be at least 1")


@dataclass
class DemoOutcome:
    """The verdict and the per-feed figures of a run."""

    exit_code: int
    tallies: list[FeedTally]
    problems: list[str]


class _Submissions:
    """Published tasks and their outcomes, shared by publisher and monitor."""

    def __init__(self, feeds: list[str]) -> None:
        self.lock = threading.Lock()
        self.tallies = {feed: FeedTally(feed) for feed in feeds}
        #: task id -> (feed, AsyncResult) of submissions without an outcome yet.
        self.pending: dict[str, tuple[str, Any]] = {}
        self.count = 0
        self.publish_error: BaseException | None = None
        self.failures: list[str] = []

    def add(self, feed: str, result: Any) -> None:
        with self.lock:
            self.pending[result.id] = (feed, result)
            self.tallies[feed].submitted += 1
            self.count += 1

    def poll(self) -> None:
        """Move finished results into the tallies (reads the result backend)."""
        with self.lock:
            pending = list(self.pending.items())
        for task_id, (feed, result) in pending:
            if not result.ready():
                continue
            tally = self.tallies[feed]
            if not result.successful():
                tally.failed += 1
                self.failures.append(f"{feed_name(feed)}: {result.result!r}")
            elif is_skipped(result.result):
                tally.skipped += 1
            else:
                tally.ran += 1
            with self.lock:
                del self.pending[task_id]


def run_demo(options: DemoOptions, echo: Callable[[str], None] = print) -> DemoOutcome:
    """Run the demo, printing as it goes; returns the verdict (exit code 0 = no feed
    ever ran twice at once and every submission was accounted for)."""
    options.validate()
    with ExitStack() as stack:
        if options.workdir is None:
            workdir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="taskguard-demo-"))
            )
        else:
            workdir = options.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        defaults = embedded_urls(workdir)
        database_url = options.database_url or defaults["database_url"]
        broker = options.broker or defaults["broker"]
        result_backend = options.result_backend or defaults["result_backend"]
        stack.enter_context(_demo_logging(workdir / "demo.log", options.verbose))
        stack.callback(reset_guards)

        queue = f"taskguard-demo-{uuid.uuid4().hex[:8]}"
        app = make_app(
            broker=broker, result_backend=result_backend, database_url=database_url, queue=queue
        )
        require_transports(app)  # before any table is made: nothing half-done
        _install_schema(echo, database_url, told=options.database_url is not None)
        log = RunLog()
        task = _register_task(app, log, options)
        check_connections(app)
        if options.broker:
            stack.callback(delete_queue, app, queue)

        feeds = feed_urls(options.feeds)
        total = options.feeds * options.duplicates * options.waves
        _print_header(echo, options, app, database_url, workdir, total)
        worker = InProcessWorker(app, concurrency=options.concurrency)
        worker.start()
        stack.callback(worker.stop)
        subs = _Submissions(feeds)
        started = time.monotonic()
        publisher = threading.Thread(
            target=_publish,
            args=(task, feeds, options, subs, started),
            name="taskguard-demo-publisher",
            daemon=True,
        )
        publisher.start()
        _monitor(echo, options, app, log, subs, publisher, started, total)
        worker.stop()
        elapsed = time.monotonic() - started
        return _verdict(echo, options, log, subs, total, elapsed)
    raise AssertionError("unreachable")  # pragma: no cover


def _install_schema(echo: Callable[[str], None], database_url: str, *, told: bool) -> None:
    """taskguard's tables, created or upgraded if needed; on a database the user named
    (``--database-url``), what was done is said."""
    before = schema.current(database_url)
    schema.upgrade(database_url)
    after = ", ".join(schema.current(database_url))
    if not told:
        return
    where = mask_url(database_url)
    if not before:
        echo(
            f"schema: created taskguard's tables in {where} (at {after}; "
            "`taskguard db downgrade` removes them)"
        )
    elif before != [after]:
        echo(f"schema: upgraded taskguard's schema in {where} from {', '.join(before)} to {after}")
    else:
        echo(f"schema: {where} already at {after}")


def _register_task(app: Celery, log: RunLog, options: DemoOptions) -> Any:
    seconds = options.import_seconds

    def import_feed(feed_url: str) -> dict[str, Any]:
        """Fetch and store one feed (here: take ``seconds`` and count entries)."""
        request = current_task.request if current_task else None
        lease = current_lease() if options.guarded else None
        token = lease.token if lease is not None else None
        with log.running(feed_url, getattr(request, "id", None), token):
            time.sleep(seconds)
        return {"feed": feed_url, "entries": random.randint(5, 30), "token": token}

    if not options.guarded:
        return app.task(name=TASK_NAME)(import_feed)
    return guarded_task(
        app=app, key=KEY_TEMPLATE, ttl=LOCK_TTL, lock="run", on_conflict="skip", name=TASK_NAME
    )(import_feed)


def _publish(
    task: Any, feeds: list[str], options: DemoOptions, subs: _Submissions, started: float
) -> None:
    """Publish the waves: every duplicate of a wave at once, from several threads."""
    try:
        with ThreadPoolExecutor(8, thread_name_prefix="taskguard-demo-submit") as pool:
            for wave in range(options.waves):
                delay = started + wave * options.wave_interval - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                batch = [feed for feed in feeds for _ in range(options.duplicates)]
                random.shuffle(batch)

                def submit(feed: str) -> None:
                    subs.add(feed, task.apply_async((feed,)))

                list(pool.map(submit, batch))
    except BaseException as exc:
        subs.publish_error = exc


def _monitor(
    echo: Callable[[str], None],
    options: DemoOptions,
    app: Celery,
    log: RunLog,
    subs: _Submissions,
    publisher: threading.Thread,
    started: float,
    total: int,
) -> None:
    """Print progress once a second and the held locks once, until every
    submission has an outcome (or the deadline passes)."""
    guard = guard_for(app)
    next_line = started + 1.0
    listed = False
    first_seen: float | None = None
    deadline: float | None = None
    while True:
        time.sleep(0.2)
        subs.poll()
        now = time.monotonic()
        running = log.running_now()
        if running and first_seen is None:
            first_seen = now
        if (
            not listed
            and options.guarded
            and running
            and (len(running) == options.feeds or now - (first_seen or now) > 0.5)
        ):
            listed = True
            infos = guard.held(prefix=KEY_TEMPLATE.format(feed_url=FEED_BASE))
            echo(f"  -- held locks at {now - started:.1f}s, as `taskguard locks` lists them:")
            for line in locks_table(infos):
                echo(f"     {line}")
        if now >= next_line:
            next_line += 1.0
            tallies = list(subs.tallies.values())
            echo("  " + progress_line(now - started, subs.count, total, tallies, running))
        if subs.publish_error is not None:
            return
        if not publisher.is_alive():
            deadline = deadline or now + options.timeout
            if not subs.pending or now > deadline:
                return


def _verdict(
    echo: Callable[[str], None],
    options: DemoOptions,
    log: RunLog,
    subs: _Submissions,
    total: int,
    elapsed: float,
) -> DemoOutcome:
    subs.poll()
    # Two independent counts of the same fact: from the recorded intervals, and the
    # in-progress counter the body kept while running. The verdict takes the worse.
    peaks = log.peak_by_feed()
    live = log.live_peak()
    runs = log.runs()
    tallies = list(subs.tallies.values())
    for tally in tallies:
        tally.max_at_once = max(peaks.get(tally.feed, 0), live.get(tally.feed, 0))
        tally.tokens = [r.token for r in runs if r.feed == tally.feed and r.token is not None]
    echo("")
    for line in summary_table(tallies, show_tokens=any(t.tokens for t in tallies)):
        echo("  " + line)
    echo("")
    problems: list[str] = []
    if subs.publish_error is not None:
        problems.append(f"publishing failed: {subs.publish_error}")
    overlapping = [t for t in tallies if t.max_at_once > 1]
    for t in overlapping:
        problems.append(f"{t.feed} was imported {t.max_at_once} times at once")
    unfinished = subs.count - sum(t.finished for t in tallies)
    if unfinished:
        problems.append(f"{unfinished} submission(s) had no result after {options.timeout:.0f}s")
    if subs.count != total and subs.publish_error is None:
        problems.append(f"only {subs.count} of {total} submissions were published")
    problems += [f"task failed: {f}" for f in subs.failures[:5]]
    ran = sum(t.ran for t in tallies)
    if ran != len(runs):
        problems.append(f"results say {ran} run(s) but the task body recorded {len(runs)}")
    if problems:
        for problem in problems:
            echo(f"  FAILED: {printable(problem, backslashes=False)}")
        if not options.guarded:
            echo("  (expected: this run used no lock; run without --unguarded to see taskguard.)")
        return DemoOutcome(EXIT_FAILED, tallies, problems)
    skipped = sum(t.skipped for t in tallies)
    echo("  OK: no feed was imported twice at once: max at once = 1 for every feed, measured")
    echo(
        f"      from the start and end times of the {len(runs)} runs; taskguard skipped "
        f"{skipped} duplicates. {elapsed:.1f}s"
    )
    return DemoOutcome(EXIT_OK, tallies, problems)


def _print_header(
    echo: Callable[[str], None],
    options: DemoOptions,
    app: Celery,
    database_url: str,
    workdir: Path,
    total: int,
) -> None:
    broker = maybe_sanitize_url(app.conf.broker_url)
    results = maybe_sanitize_url(app.conf.result_backend)
    echo('taskguard demo: the Celery cookbook\'s "only one at a time" feed importer')
    echo(f"  locks    {mask_url(database_url)}")
    echo(f"  broker   {broker}")
    echo(f"  results  {results}")
    echo(
        f"  worker   a real Celery worker started in this process (threads pool, "
        f"{options.concurrency} threads);"
    )
    echo("           (production: prefork processes on many hosts; the lock works the same)")
    if options.guarded:
        echo(
            f'  task     @guarded_task(key="{KEY_TEMPLATE}", ttl={LOCK_TTL}, lock="run", '
            f'on_conflict="skip") import_feed(feed_url), ~{options.import_seconds:g}s per import'
        )
    else:
        echo("  task     import_feed(feed_url) WITHOUT taskguard (--unguarded)")
    echo(
        f"  load     {options.feeds} feeds x {options.duplicates} duplicates x {options.waves} "
        f"waves {options.wave_interval:g}s apart = {total} submissions, published concurrently"
    )
    kept = "kept" if options.workdir is not None else "deleted at exit; --workdir DIR keeps them"
    echo(f"  files    {workdir} ({kept})")
    echo("")


@contextmanager
def _demo_logging(path: Path, verbose: bool) -> Iterator[None]:
    """Send taskguard's and Celery's logs (every lock conflict, with its holder) to
    ``path``, and to stderr as well with ``verbose``."""
    handlers: list[logging.Handler] = [logging.FileHandler(path, encoding="utf-8")]
    if verbose:
        handlers.append(logging.StreamHandler(sys.stderr))
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s")
    loggers = [logging.getLogger(name) for name in ("taskguard", "celery", "kombu")]
    saved = [(lg, lg.level, lg.propagate) for lg in loggers]
    for handler in handlers:
        handler.setFormatter(fmt)
    for lg in loggers:
        lg.setLevel(logging.INFO)
        lg.propagate = False
        for handler in handlers:
            lg.addHandler(handler)
    try:
        yield
    finally:
        for lg, level, propagate in saved:
            for handler in handlers:
                lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate
        for handler in handlers:
            handler.close()
