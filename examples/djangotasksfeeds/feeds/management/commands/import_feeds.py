"""``manage.py import_feeds``: many duplicate enqueues of one of the feed tasks,
run by ``db_worker`` processes (their log: ``var/workers.log``), then a line per feed: enqueued, refused, answered
with the queued job, ran, skipped, and the most runs of that feed ever in progress
at once (from the runs' own start and end times). Exits 1 unless that is at most 1
for every feed and every job finished.

By default it starts two ``manage.py db_worker`` processes and stops them at the
end; ``--workers 0`` uses workers started elsewhere. ``--json`` prints the figures
as JSON.
"""

import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django_tasks_db.models import DBTaskResult

from feeds import tasks
from feeds.models import ImportRun
from taskguard import AlreadyLocked
from taskguard.contrib.django_tasks import is_skipped


def most_at_once(runs: list[ImportRun]) -> int:
    """The largest number of ``runs`` in progress at the same instant (-1: one of
    them never finished)."""
    edges = []
    for run in runs:
        if run.ended_at is None:
            return -1
        edges += [(run.started_at, 1), (run.ended_at, -1)]
    at_once = best = 0
    for _, step in sorted(edges):  # at equal times an end (-1) sorts before a start
        at_once += step
        best = max(best, at_once)
    return best


class Command(BaseCommand):
    help = "Enqueue duplicate feed imports and show that no feed was imported twice at once."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--task", default="import_feed",
                            choices=["import_feed", "import_feed_once", "import_feed_strict"])  # fmt: skip
        parser.add_argument("--feeds", type=int, default=5)
        parser.add_argument("--submissions", type=int, default=200)
        parser.add_argument("--workers", type=int, default=2)
        parser.add_argument("--timeout", type=float, default=150.0)
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        call_command("migrate", verbosity=0)  # the feeds', the queue's and taskguard's tables
        task = getattr(tasks, options["task"])
        feeds = [f"https://example.com/feeds/{n}.rss" for n in range(options["feeds"])]
        batch = uuid.uuid4().hex
        log = open(settings.VAR_DIR / "workers.log", "a")  # noqa: SIM115
        workers = [
            subprocess.Popen([sys.executable, "manage.py", "db_worker", "--interval", "0.1",
                              "--no-startup-delay", "--no-reload", "--worker-id", f"feeds-{n}-{batch[:6]}"],
                             stdout=log, stderr=subprocess.STDOUT)
            for n in range(options["workers"])
        ]  # fmt: skip
        ids: dict[str, Counter[str]] = {f: Counter() for f in feeds}
        refused: Counter[str] = Counter()
        try:
            for i in range(options["submissions"]):
                feed = feeds[i * len(feeds) // options["submissions"]]  # a feed's in a row
                try:
                    ids[feed][task.enqueue(feed, batch).id] += 1
                except AlreadyLocked:
                    refused[feed] += 1
            jobs = [job for counter in ids.values() for job in counter]
            deadline = time.monotonic() + options["timeout"]
            while DBTaskResult.objects.filter(id__in=jobs, finished_at__isnull=True).exists():
                if time.monotonic() > deadline:
                    raise CommandError(f"jobs still unfinished after {options['timeout']}s")
                time.sleep(0.2)
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                worker.wait(30)
            log.close()
        self._report(batch, feeds, ids, refused, options["json"])

    def _report(self, batch: str, feeds: list[str], ids: dict[str, Counter[str]],
                refused: Counter[str], as_json: bool) -> None:  # fmt: skip
        rows = []
        for feed in feeds:
            jobs = DBTaskResult.objects.filter(id__in=list(ids[feed]))
            runs = list(ImportRun.objects.filter(batch=batch, feed_url=feed))
            rows.append({
                "feed": feed,
                "enqueued": sum(ids[feed].values()) + refused[feed],
                "refused": refused[feed],
                "answered_existing": sum(ids[feed].values()) - len(ids[feed]),
                "jobs": len(ids[feed]),
                "failed": sum(1 for j in jobs if j.status == "FAILED"),
                "skipped": sum(1 for j in jobs if is_skipped(j.return_value)),
                "ran": len(runs),
                "most_at_once": most_at_once(runs),
            })  # fmt: skip
        if as_json:
            self.stdout.write(json.dumps(rows))
        else:
            names = list(rows[0])
            self.stdout.write("  ".join(f"{n:>17}" for n in names))
            for row in rows:
                self.stdout.write("  ".join(f"{row[n]!s:>17}" for n in names))
        if any(row["most_at_once"] != 1 or row["failed"] for row in rows):
            raise CommandError("a feed was imported twice at once, or a job failed or never ended")
