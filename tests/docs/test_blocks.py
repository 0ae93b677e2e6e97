"""Every fenced code block of README.md and docs/*.md runs (as a test item of
tests/docs/plugin.py) or carries ``<!-- not run: <reason> -->``; the page specs
(tests/docs/pages.py) match the pages. ``pytest tests/docs/test_blocks.py -s``
prints the count per page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.blocks import REPO, blocks, markers, pages
from tests.docs.pages import PAGES
from tests.docs.plugin import runs, spec_of


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", pages(), ids=_name)
def test_every_block_runs_or_says_why_not(page: Path) -> None:
    problems = []
    for block in blocks(page):
        if block.marker == "":
            problems.append(f"{block.name}: `<!-- not run: -->` needs a reason")
        elif block.marker is None and block.kind is None:
            what = f"a {block.language} block" if block.language else "a block with no language"
            if block.language in ("ini", "toml", "cfg"):
                what += " without a `# <path>` first line"
            problems.append(
                f"{block.name}: {what} cannot run; make it runnable or put "
                "`<!-- not run: <one-line reason> -->` on the line before its fence"
            )
    for line, reason, fenced in markers(page):
        for path in re.findall(r"\b(?:tests|scripts|examples)/[\w./-]*\w", reason):
            if not (REPO / path).exists():
                problems.append(
                    f"{_name(page)}:{line}: the reason names {path}, which does not exist"
                )
        if not fenced:
            problems.append(
                f"{_name(page)}:{line}: `<!-- not run: {reason} -->` is not followed by a fence"
            )
    spec = spec_of(page)
    scenarios = list(spec.scenarios) or [""]
    if spec.run_by:
        journey = (REPO / spec.run_by).read_text()
        problems += [
            f"{_name(page)}: {spec.run_by} runs no scenario {s!r}"
            for s in scenarios
            if f'"{s}"' not in journey
        ]
    in_any = {b.line for s in scenarios for b in runs(page, s)}
    for block in blocks(page):
        if block.marker is None and block.kind is not None and block.line not in in_any:
            problems.append(f"{block.name}: in none of the page's scenarios {scenarios}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", sorted(PAGES))
def test_page_specs_match_their_pages(path: str) -> None:
    page = REPO / path
    assert page.is_file(), f"tests/docs/pages.py names a page that does not exist: {path}"
    spec = PAGES[path]
    run_text = "\n".join(b.source for s in (list(spec.scenarios) or [""]) for b in runs(page, s))
    for url in spec.urls:
        assert url in run_text, (
            f"{path} no longer has {url!r} in a block that runs; update pages.py"
        )
    for needle in spec.checks:
        found = (
            [b.name for b in runs(page) if needle in b.source]
            if not spec.scenarios
            else [b.name for s in spec.scenarios for b in runs(page, s) if needle in b.source]
        )
        assert len(set(found)) == 1, f"check {needle!r} must match one block of {path}: {found}"


def test_count(capsys: pytest.CaptureFixture[str]) -> None:
    """The table for the issue's note: blocks run and blocks marked, per page."""
    rows = []
    for page in pages():
        found = blocks(page)
        marked = sum(1 for b in found if b.marker)
        rows.append((_name(page), len(found) - marked, marked))
    total_run = sum(r[1] for r in rows)
    total_marked = sum(r[2] for r in rows)
    with capsys.disabled():
        print(f"\n{'page':<22} {'run':>4} {'marked':>7}")
        for name, run, marked in rows:
            print(f"{name:<22} {run:>4} {marked:>7}")
        print(f"{'total':<22} {total_run:>4} {total_marked:>7}")
    assert total_run > 0
