"""``taskguard demo``: Celery's "only one at a time" feed importer on an embedded
setup (SQLite locks, SQLite-backed broker and results, an in-process worker)."""

from taskguard.demo.runner import FEED_NAMES, DemoOptions, DemoOutcome, feed_urls, run_demo

__all__ = ["FEED_NAMES", "DemoOptions", "DemoOutcome", "feed_urls", "run_demo"]
