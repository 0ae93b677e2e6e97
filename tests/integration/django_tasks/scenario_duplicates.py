"""Run in the example project (cwd), after migrate: 50 simultaneous enqueues of one
feed's ``import_feed_once`` (lock="queue_and_run", on_conflict="existing") from 3
processes x 5 threads, no worker running. Prints JSON: the job ids answered and the
errors raised (issue 41, defect 2: a duplicate in the gap between the first enqueue's
acquire and its job's creation raised AlreadyLocked)."""

import json
import subprocess
import sys
import threading
import time

import django

django.setup()

from django.db import connection  # noqa: E402
from feeds.tasks import import_feed_once  # noqa: E402

FEED = "https://example.com/feeds/duplicates.rss"
PROCESSES, THREADS, ENQUEUES = 3, 5, 50


def enqueue_some(count: int, start_at: float, out: list[str]) -> None:
    time.sleep(max(0.0, start_at - time.time()))
    for _ in range(count):
        try:
            out.append("job " + str(import_feed_once.enqueue(FEED).id))
        except Exception as exc:
            out.append(f"error {type(exc).__name__}: {exc}")
    connection.close()


if sys.argv[1:2] == ["child"]:
    index, start_at = int(sys.argv[2]), float(sys.argv[3])
    answers: list[str] = []
    counts = [
        len(range(index * THREADS + t, ENQUEUES, PROCESSES * THREADS)) for t in range(THREADS)
    ]
    threads = [threading.Thread(target=enqueue_some, args=(n, start_at, answers)) for n in counts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(answers))
else:
    start = time.time() + 4.0  # every process set up and waiting
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "child", str(n), str(start)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(PROCESSES)
    ]
    answers = []
    for child in children:
        out, _ = child.communicate(timeout=120)
        answers += json.loads(out.strip().splitlines()[-1])
    print(json.dumps(answers))
