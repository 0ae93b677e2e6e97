"""pytest plugin (loaded by the repository's root conftest.py): every fenced code
block of README.md and docs/*.md is a test item, run by Sybil.

Why Sybil (and not pytest-markdown-docs): a page's blocks must run in order in one
session of the reader's (Python blocks sharing their names, a worker started by a
``bash`` block still running for the ``python`` block after it), and ``bash``,
``console``, ``sql`` and file blocks run too. Sybil's parsers and evaluators are
plain callables over a page's text with per-document state, so those kinds are a
few lines each; pytest-markdown-docs runs Python fences only, each on its own.

A block marked ``<!-- not run: <reason> -->`` on the line right before its fence is
not collected; tests/docs/test_blocks.py makes sure every other block is one that
runs (tests/docs/blocks.py lists the kinds) and prints the count per page. What
each kind does, and the one change made to a block (its URLs), is in
tests/docs/runner.py; each page's URL mapping and scenarios in tests/docs/pages.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.integration.pytest import SybilItem
from sybil.integration.pytest import pytest_integration as _sybil_hook

from tests.docs.blocks import REPO, Block, blocks
from tests.docs.pages import PAGES
from tests.docs.runner import Page, PageSpec

DEFAULT = PageSpec()


def spec_of(path: Path) -> PageSpec:
    return PAGES.get(str(path.relative_to(REPO)), DEFAULT)


def runs(path: Path, scenario: str = "") -> list[Block]:
    """The blocks of the page a scenario runs, in order."""
    spec = spec_of(path)
    return [
        b
        for b in blocks(path)
        if b.marker is None and b.kind is not None and spec.includes(scenario, b.heading)
    ]


class _Parser:
    def __init__(self, scenario: str) -> None:
        self.scenario = scenario

    def __call__(self, document: Document) -> Iterator[Region]:
        path = Path(document.path)
        todo = runs(path, self.scenario)
        for block in todo:
            yield Region(
                block.start,
                block.end,
                parsed=(block, block is todo[-1]),
                evaluator=self._evaluate,
            )

    def _evaluate(self, example: Example) -> None:
        block, last = example.parsed
        namespace = example.namespace
        page = namespace.get("page")
        if page is None:
            page = namespace["page"] = Page(block.page, spec_of(block.page), self.scenario)
            page.open()
        try:
            page.run(block)
        finally:
            if last:  # free the page's databases and processes at once
                _teardown(namespace)


def _teardown(namespace: dict[str, Any]) -> None:
    page = namespace.pop("page", None)
    if page is not None:
        page.close()


def _sybils() -> list[Sybil]:
    # A page with scenarios is collected once per scenario; one a journey runs, not at all.
    apart = [path for path, spec in PAGES.items() if spec.scenarios or spec.run_by]
    found = [
        Sybil(
            parsers=[_Parser("")],
            path=str(REPO),
            patterns=["README.md", "docs/*.md"],
            excludes=apart,
            teardown=_teardown,
        )
    ]
    for path, spec in PAGES.items():
        for scenario in () if spec.run_by else spec.scenarios:
            found.append(
                Sybil(
                    parsers=[_Parser(scenario)],
                    path=str(REPO),
                    patterns=[path],
                    teardown=_teardown,
                    name=scenario,
                )
            )
    return found


#: The hook Sybil provides: a .md file the Sybils above match becomes a test file.
pytest_collect_file = _sybil_hook(*_sybils())


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, SybilItem):
            item.add_marker(pytest.mark.docs)
