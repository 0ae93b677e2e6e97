"""Run with celerysite's settings: examples/djangotasksfeeds' feed tasks on a real
prefork ``celery worker -c 2`` through django-tasks-celery. Prints one JSON line.

``scenario_celery.py TASK``: 200 enqueues of TASK over 5 feeds (a feed's in a row),
then per feed: enqueued, refused, answered with the queued job, jobs, failed,
skipped, ran, and the most runs of it in progress at once (ImportRun: each run's own
start and end by the database clock).

``scenario_celery.py kill``: an ``import_feed_once`` run's pool process is SIGKILLed
mid-run; until its lease runs out an enqueue of that feed is answered with the dead
job, after that a new job is accepted and runs to the end.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from feeds import tasks  # noqa: E402
from feeds.management.commands.import_feeds import most_at_once  # noqa: E402
from feeds.models import ImportRun  # noqa: E402

from taskguard import AlreadyLocked  # noqa: E402
from taskguard.contrib.django_tasks import is_skipped  # noqa: E402

DONE = ("SUCCESSFUL", "FAILED")


def wait(what, predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.1)


def imports(task, batch):
    feeds = [f"https://example.com/feeds/{n}.rss" for n in range(5)]
    ids = {f: Counter() for f in feeds}
    refused = Counter()
    for i in range(200):
        feed = feeds[i * len(feeds) // 200]
        try:
            ids[feed][task.enqueue(feed, batch).id] += 1
        except AlreadyLocked:
            refused[feed] += 1
    results = {}

    def finished():
        for job in (j for c in ids.values() for j in c if j not in results):
            result = task.get_backend().get_result(job)  # (a pending job: no .task)
            if result.status not in DONE:
                return False
            results[job] = result
        return True

    wait("every job to finish", finished)
    rows = []
    for feed in feeds:
        jobs = [results[j] for j in ids[feed]]
        runs = list(ImportRun.objects.filter(batch=batch, feed_url=feed))
        rows.append({
            "enqueued": sum(ids[feed].values()) + refused[feed],
            "refused": refused[feed],
            "answered_existing": sum(ids[feed].values()) - len(ids[feed]),
            "jobs": len(ids[feed]),
            "failed": sum(1 for j in jobs if j.status == "FAILED"),
            "skipped": sum(1 for j in jobs if j.status == "SUCCESSFUL" and is_skipped(j.return_value)),
            "ran": len(runs),
            "most_at_once": most_at_once(runs),
        })  # fmt: skip
    return rows


def kill(batch):
    feed = "https://example.com/feeds/killed.rss"
    task = tasks.import_feed_once
    first = task.enqueue(feed, batch)
    wait("the first run", lambda: ImportRun.objects.filter(batch=batch).exists())
    os.kill(ImportRun.objects.get(batch=batch).pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # While the dead run's lease lives, an enqueue is answered with its job.
    answer = task.enqueue(feed, batch)
    answered_while_held = answer.id == first.id
    # The answer is a whole TaskResult: it names its task, so refresh() works.
    answer_has_task = answer.task is not None and answer.task.func is task.func
    if answer_has_task:
        answer.refresh()
    second = first
    while second.id == first.id:
        time.sleep(0.1)
        second = task.enqueue(feed, batch)
    accepted_after = time.monotonic() - killed_at
    wait("the second run", lambda: task.get_backend().get_result(second.id).status in DONE)
    started_after = (
        ImportRun.objects.filter(batch=batch).order_by("-started_at")[0].started_at
        - ImportRun.objects.filter(batch=batch).order_by("started_at")[0].started_at
    ).total_seconds()
    done = task.get_backend().get_result(second.id)
    return {
        "first_status": task.get_backend().get_result(first.id).status,
        "answered_while_held": answered_while_held,
        "answer_has_task": answer_has_task,
        "accepted_after_s": round(accepted_after, 2),
        "second_started_after_first_s": round(started_after, 2),
        "second_status": done.status,
        "second_return": done.return_value if done.status == "SUCCESSFUL" else None,
        "runs": ImportRun.objects.filter(batch=batch).count(),
    }


call_command("migrate", verbosity=0)
worker = subprocess.Popen(
    [sys.executable, "-m", "celery", "-A", "celerysite.celery", "worker", "-P", "prefork",
     "-c", "2", "-n", f"celerysite-{uuid.uuid4().hex[:6]}@%h", "-l", "info",
     "--without-gossip", "--without-mingle", "--without-heartbeat"],
    stdout=sys.stderr, stderr=sys.stderr,
)  # fmt: skip
try:
    batch = uuid.uuid4().hex
    started = time.monotonic()
    out = kill(batch) if sys.argv[1] == "kill" else imports(getattr(tasks, sys.argv[1]), batch)
    print(json.dumps({"seconds": round(time.monotonic() - started, 1), "rows": out}))
finally:
    worker.terminate()
    worker.wait(30)
