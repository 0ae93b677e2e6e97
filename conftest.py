"""The docs' code blocks as tests: see tests/docs/plugin.py. The order of a parallel
run's test files: below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["tests.docs.plugin"]

#: Seconds each test file took in a whole-suite run (scripts/test_durations.py).
DURATIONS = Path(__file__).resolve().parent / "tests" / "durations.json"
#: A file not measured yet: ahead of the many short ones, behind the long ones.
UNMEASURED = 30


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist process: the longest files first (scripts/test.sh passes
    ``--dist loadfile --no-loadscope-reorder``: a file runs whole in one process, the
    files handed out in this order), so that no minutes-long file starts last and
    leaves the run waiting on one process. A file's tests keep their order."""
    if not hasattr(config, "workerinput"):
        return
    seconds = json.loads(DURATIONS.read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], UNMEASURED))
