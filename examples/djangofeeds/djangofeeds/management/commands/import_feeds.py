"""``manage.py import_feeds``: many duplicate ``import_feed`` submissions at once,
then a table per feed: submitted, ran, skipped, and the most runs of that feed
ever in progress at once (from the runs' start and end times). Exits 1 unless that
is 1 for every feed and every submission either ran or was skipped.

By default a real Celery worker (threads pool) runs inside this command, on the
broker in the settings (the embedded SQLite broker unless DJANGOFEEDS_BROKER is
set). ``--no-worker`` publishes to workers started elsewhere
(``celery -A feedsite worker``).

The skipped duplicates are the point of the command, and each is logged at WARNING
with the key and its holder: this command writes taskguard's log lines to
``import_feeds.log`` next to the database (``-v 2`` prints them too), not
between you and the table. Workers started elsewhere log as usual.
"""

import contextlib
import logging
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from feedsite.celery import app

from djangofeeds.models import ImportRun
from djangofeeds.tasks import import_feed
from taskguard import is_skipped
from taskguard.demo.embedded import InProcessWorker


def most_at_once(runs: list[ImportRun]) -> int:
    """The largest number of ``runs`` in progress at the same instant."""
    edges = []
    for run in runs:
        if run.ended_at is None:
            return -1  # a run that never finished: report it as a failure
        edges += [(run.started_at, 1), (run.ended_at, -1)]
    at_once = best = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):  # ends before starts
        at_once += step
        best = max(best, at_once)
    return best


class Command(BaseCommand):
    help = "Submit duplicate import_feed calls and show that no feed was imported twice at once."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--feeds", type=int, default=5)
        parser.add_argument("--submissions", type=int, default=60)
        parser.add_argument("--queue", default="djangofeeds")
        parser.add_argument("--concurrency", type=int, default=8)
        parser.add_argument("--timeout", type=float, default=120.0)
        parser.add_argument(
            "--no-worker", action="store_true", help="Use workers started elsewhere."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        call_command("migrate", verbosity=0)  # the feeds' tables and taskguard's
        log_file = settings.VAR_DIR / "import_feeds.log"
        with _taskguard_log(log_file, echo=options["verbosity"] > 1):
            self._import(options)
        self.stdout.write(f"Every lock conflict, with its holder: {log_file}")

    def _import(self, options: dict[str, Any]) -> None:
        queue = options["queue"]
        app.conf.task_default_queue = queue
        feeds = [f"https://example.com/feeds/{n}.rss" for n in range(options["feeds"])]
        batch = uuid.uuid4().hex
        worker = (
            contextlib.nullcontext()
            if options["no_worker"]
            else InProcessWorker(app, concurrency=options["concurrency"], hostname=f"{queue}@%h")
        )
        with worker:
            calls = [feeds[i % len(feeds)] for i in range(options["submissions"])]
            with ThreadPoolExecutor(max_workers=8) as pool:
                results = list(
                    pool.map(lambda url: (url, import_feed.delay(url, batch=batch)), calls)
                )
            outcome: dict[str, dict[str, int]] = defaultdict(lambda: {"ran": 0, "skipped": 0})
            for url, result in results:
                # The in-process worker marks this process as a worker; this is no task.
                value = result.get(timeout=options["timeout"], disable_sync_subtasks=False)
                outcome[url]["skipped" if is_skipped(value) else "ran"] += 1
        runs: dict[str, list[ImportRun]] = defaultdict(list)
        for run in ImportRun.objects.filter(batch=batch):
            runs[run.feed_url].append(run)
        ok = True
        self.stdout.write(f"{'FEED':<36} {'SUBMITTED':>9} {'RAN':>5} {'SKIPPED':>7} {'AT ONCE':>7}")
        for url in feeds:
            submitted = calls.count(url)
            ran, skipped = outcome[url]["ran"], outcome[url]["skipped"]
            at_once = most_at_once(runs[url])
            ok &= at_once == 1 and ran + skipped == submitted and ran == len(runs[url])
            self.stdout.write(f"{url:<36} {submitted:>9} {ran:>5} {skipped:>7} {at_once:>7}")
        if not ok:
            raise CommandError("a feed was imported more than once at a time, or a call was lost")
        self.stdout.write("OK: every feed was imported by one worker at a time")


@contextlib.contextmanager
def _taskguard_log(path: Any, echo: bool) -> Any:
    """taskguard's log lines to ``path`` (and to stderr as well with ``echo``)."""
    handlers: list[logging.Handler] = [logging.FileHandler(path, encoding="utf-8")]
    if echo:
        handlers.append(logging.StreamHandler())
    logger = logging.getLogger("taskguard")
    propagate = logger.propagate
    logger.propagate = False
    for handler in handlers:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logger.addHandler(handler)
    try:
        yield
    finally:
        logger.propagate = propagate
        for handler in handlers:
            logger.removeHandler(handler)
            handler.close()
