"""Run in the example project (cwd): a worker SIGKILLed mid-run leaves nothing stuck.

Two db_workers; an ``import_feed_once`` job starts; its worker is SIGKILLed. Until
the lease runs out a new enqueue of that feed is answered with the dead job; after,
it is a new job and
the other worker runs it to the end (its lease renewed past the ttl). Prints JSON.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import django

django.setup()

from django_tasks_db.models import DBTaskResult  # noqa: E402
from feeds.models import ImportRun  # noqa: E402
from feeds.tasks import import_feed_once  # noqa: E402


def wait(what, predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.1)


FEED = "https://example.com/feeds/killed.rss"
workers = [
    subprocess.Popen([sys.executable, "manage.py", "db_worker", "--interval", "0.1",
                      "--no-startup-delay", "--no-reload", "--worker-id", f"kill-{n}"],
                     stdout=sys.stderr)
    for n in range(2)
]  # fmt: skip
try:
    first = import_feed_once.enqueue(FEED, "kill")
    wait("the first run", lambda: ImportRun.objects.filter(batch="kill").exists())
    victim = ImportRun.objects.get(batch="kill").pid
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    # While the dead run's lease lives, an enqueue is answered with its job.
    # (aenqueue: django-tasks-db's own aenqueue does not call enqueue; GuardedBackend's does)
    answered_while_held = asyncio.run(import_feed_once.aenqueue(FEED, "kill")).id == first.id
    second = first
    while second.id == first.id:
        time.sleep(0.1)
        second = import_feed_once.enqueue(FEED, "kill")
    accepted_after = time.monotonic() - killed_at
    wait("the second run", lambda: DBTaskResult.objects.get(id=second.id).finished_at, 90)
    done = DBTaskResult.objects.get(id=second.id)
    print(json.dumps({
        "answered_while_held": answered_while_held,
        "accepted_after_s": round(accepted_after, 2),
        "second_status": done.status,
        "second_return": done.return_value,
        "runs": ImportRun.objects.filter(batch="kill").count(),
    }))  # fmt: skip
finally:
    for w in workers:
        if w.poll() is None:
            w.terminate()
    for w in workers:
        w.wait(30)
