"""Send 200 imports of 5 feeds to the workers (``dramatiq feeds -p 2 -t 4``), wait
for the queue to drain, and print per feed: sent, refused at send, ran, and the most
imports of that feed in progress at once (always 1). ``--once``: the queue-locked
actor (a duplicate send refused)."""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter, defaultdict

from feeds import LOG, QUEUE, broker, import_feed, import_feed_once

from taskguard import AlreadyLocked

FEEDS = [f"https://example.com/feeds/{n}.rss" for n in range(5)]


def main() -> int:
    logging.getLogger("taskguard").setLevel(logging.ERROR)  # one WARNING per refused send
    actor = import_feed_once if "--once" in sys.argv else import_feed
    LOG.parent.mkdir(exist_ok=True)
    LOG.write_text("")
    sent, refused = Counter(), Counter()
    for n in range(200):
        feed = FEEDS[n % 5]
        sent[feed] += 1
        try:
            actor.send(feed)
        except AlreadyLocked:
            refused[feed] += 1
    broker.join(QUEUE, timeout=120_000)
    time.sleep(1)  # the last messages' hooks
    edges = defaultdict(list)
    for line in LOG.read_text().splitlines():
        event, feed, at = line.split()
        edges[feed].append((float(at), 1 if event == "start" else -1))
    print(f"{'feed':<36} {'sent':>5} {'refused':>8} {'ran':>5} {'at once':>8}")
    worst = 0
    for feed in FEEDS:
        now = peak = 0
        for _, step in sorted(edges[feed]):
            now += step
            peak = max(peak, now)
        worst = max(worst, peak)
        ran = sum(1 for _, step in edges[feed] if step == 1)
        print(f"{feed:<36} {sent[feed]:>5} {refused[feed]:>8} {ran:>5} {peak:>8}")
    return 0 if worst == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
