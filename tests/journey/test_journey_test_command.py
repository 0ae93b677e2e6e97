"""The README's second command, ``scripts/test.sh`` (its test command, all set-up
included). CI runs it itself (.ci/run: a fresh virtualenv, ``pip install -e
".[dev]"``, ``bash scripts/test.sh``); this journey does not run the suite inside
the suite, but runs the command's set-up path for real, as a newcomer would on a
fresh checkout in a fresh virtualenv (the Debian packages' check, the dev install),
ending in a pytest that only collects: ``scripts/test.sh --collect-only -q tests/unit``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.blocks import REPO, blocks
from tests.journey.venvs import UserVenv, checkout

README = REPO / "README.md"


def _bash_blocks() -> list[str]:
    return [b.source for b in blocks(README) if b.language == "bash"]


def test_readme_names_the_command_ci_runs() -> None:
    [tests] = [b for b in _bash_blocks() if "scripts/test.sh" in b]
    assert [line.split("#")[0].strip() for line in tests.splitlines()] == ["scripts/test.sh"]
    ci = (REPO / ".ci" / "run").read_text()
    assert "python3 -m venv --clear" in ci and '-e ".[dev]"' in ci
    assert "\nbash scripts/test.sh\n" in ci
    # The test command installs what the tests start private copies of, then pytest.
    script = (REPO / "scripts" / "test.sh").read_text()
    assert "scripts/services.sh" in script and 'python3 -m pytest "$@"' in script


def test_readme_links_and_a_short_quickstart() -> None:
    text = README.read_text()
    for doc in re.findall(r"\]\((docs/[\w.]+|examples/\w+)\)", text):
        assert (REPO / doc).exists(), doc
    quickstart = [b for b in blocks(README) if b.heading == "Quickstart" and b.marker is None]
    tasks = next(b.source for b in quickstart if "@guarded_task" in b.source)
    commands = next(b.source for b in quickstart if "taskguard db upgrade" in b.source)
    assert len(tasks.strip().splitlines()) <= 15
    assert len(tasks.strip().splitlines()) + len(commands.strip().splitlines()) <= 20


@pytest.mark.journey
@pytest.mark.timeout(600)
def test_set_up_path_on_a_fresh_checkout(tmp_path: Path) -> None:
    src = checkout(tmp_path / "taskguard")
    env = UserVenv(tmp_path / "venv")
    out = env.must("scripts/test.sh --collect-only -q tests/unit", cwd=src)
    assert re.search(r"^\d+ tests collected", out, re.M), out[-2000:]
    # The dev install is the checkout's, editable, in the new virtualenv.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert env.installed_from("taskguard", cwd=elsewhere) == str(src / "taskguard" / "__init__.py")
