"""Kick 120 duplicate imports of 5 feeds at once, wait for every result, and print per
feed: kicked, ran, skipped, and the most runs of it ever in progress at once (from the
records the runs wrote). Exits 1 unless that is 1 for every feed and every kick ran or
was skipped."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter

from feeds import RUNS_FILE, broker, import_feed

from taskguard import is_skipped

FEEDS = [f"https://example.com/feeds/{n}.rss" for n in range(5)]


def most_at_once(url: str, runs: list[dict[str, object]]) -> int:
    edges = sorted(
        (r[k], +1 if k == "start" else -1)
        for r in runs
        if r["url"] == url
        for k in ("start", "end")
    )
    now = peak = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        now += step
        peak = max(peak, now)
    return peak


async def main() -> int:
    if os.path.exists(RUNS_FILE):
        os.remove(RUNS_FILE)
    await broker.startup()
    urls = [FEEDS[i % 5] for i in range(120)]
    handles = [await import_feed.kiq(url) for url in urls]
    results = [(await h.wait_result(timeout=120)).return_value for h in handles]
    await broker.shutdown()
    with open(RUNS_FILE) as f:
        runs = [json.loads(line) for line in f]
    ran = Counter(r["url"] for r in runs)
    skipped = Counter(url for url, value in zip(urls, results, strict=True) if is_skipped(value))
    ok = True
    print(f"{'feed':<34} kicked  ran  skipped  most at once")
    for url in FEEDS:
        most = most_at_once(url, runs)
        kicked = urls.count(url)
        ok = ok and most == 1 and ran[url] + skipped[url] == kicked
        print(f"{url:<34} {kicked:>6} {ran[url]:>4} {skipped[url]:>8} {most:>13}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
