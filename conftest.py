"""The docs' code blocks as tests: see tests/docs/plugin.py. How a parallel run
(``-n 4 --dist loadgroup``, scripts/test.sh) shares out the suite: below."""

from __future__ import annotations

from collections import Counter

import pytest

pytest_plugins = ["tests.docs.plugin"]

#: What one test costs, roughly, by marker (the first that applies; else 1): a
#: journey builds virtualenvs and starts workers (minutes), a `slow` test runs real
#: workers for tens of seconds, a `celery` test starts or waits on a worker.
COST = {"journey": 60, "slow": 20, "celery": 3}


def _group(item: pytest.Item) -> str:
    """A file's tests run in one process, in file order (a page's code blocks share
    one session, a module's worker serves all its tests), like ``--dist loadfile``;
    but the tests of each value of a module-scoped parametrized fixture (a worker per
    store or pool) are a group of their own, so that a file of several workers
    spreads over the processes instead of keeping one busy for the whole run."""
    group = item.nodeid.split("::")[0]
    callspec = getattr(item, "callspec", None)
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if callspec is not None:
        for name in sorted(callspec.params):
            if name in defs and defs[name][-1].scope != "function":
                # No "]" in a group: xdist takes what follows the last "@" past any "]".
                group += f"::{name}={callspec.indices[name]}"
    return group


def _cost(item: pytest.Item) -> int:
    return next((c for m, c in COST.items() if item.get_closest_marker(m)), 1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup``: each test's group (above) as its xdist_group, and
    the groups ordered costliest first (xdist hands them out in collection order), so
    that the minutes-long ones do not start last and leave the run waiting on one
    process. Elsewhere the suite runs as collected."""
    if not getattr(config.option, "loadgroup", False):
        return
    groups = {item: _group(item) for item in items}
    cost: Counter[str] = Counter()
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        cost[groups[item]] += _cost(item)
        first.setdefault(groups[item], i)
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    items.sort(key=lambda item: (-cost[groups[item]], first[groups[item]]))
