"""``taskguard demo``: Celery's "only one at a time" feed importer on an embedded
setup (SQLite locks, SQLite-backed broker and results, an in-process worker)."""

from taskguard.demo.runner import DemoOptions, run_demo

__all__ = ["DemoOptions", "run_demo"]
