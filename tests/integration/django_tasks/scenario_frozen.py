"""Run with tinysite's settings (locks behind the test's proxy): one connection made,
prints "ready"; on "go" enqueues ``queued_long(1)`` (lock="queue_and_run", queue
ttl 300 s) and prints what it raised; stays up (its release thread with it) until
stdin closes."""

import sys

import django

django.setup()

from tinytasks import tasks  # noqa: E402

from taskguard.contrib.django_tasks import project_guard  # noqa: E402

project_guard().db_now()  # the pinned connection, past start-up
print("ready", flush=True)
sys.stdin.readline()
try:
    tasks.queued_long.enqueue(1)
    print("enqueued", flush=True)
except Exception as exc:
    print(f"raised {type(exc).__name__}", flush=True)
sys.stdin.read()
