"""The README's second command, ``scripts/test.sh`` (its test command, all set-up
included), is what CI runs, set-up first: .ci/run makes a fresh virtualenv in a
fresh clone and runs the command's set-up path alone (the Debian packages' check,
the dev install, a pytest that only collects), then the whole command, which finds
the install done. The README names it, and the Quickstart is short.
"""

from __future__ import annotations

import re

from tests.docs.blocks import REPO, blocks

README = REPO / "README.md"


def _bash_blocks() -> list[str]:
    return [b.source for b in blocks(README) if b.language == "bash"]


def test_readme_names_the_command_ci_runs() -> None:
    [tests] = [b for b in _bash_blocks() if "scripts/test.sh" in b]
    assert [line.split("#")[0].strip() for line in tests.splitlines()] == ["scripts/test.sh"]
    ci = (REPO / ".ci" / "run").read_text()
    fresh = ci.index("python3 -m venv --clear")
    set_up = ci.index("bash scripts/test.sh --collect-only")
    # Nothing installs taskguard in CI's fresh virtualenv but the command's own set-up.
    assert fresh < set_up < ci.index("\nbash scripts/test.sh\n")
    installs = [line for line in ci[fresh:set_up].splitlines() if "pip install" in line]
    assert all(line.endswith("--upgrade pip") for line in installs), installs
    # The test command installs what the tests start private copies of, then pytest.
    script = (REPO / "scripts" / "test.sh").read_text()
    assert "scripts/services.sh" in script and '-e ".[dev]"' in script
    assert 'python3 -m pytest "$@"' in script


def test_readme_links_and_a_short_quickstart() -> None:
    text = README.read_text()
    for doc in re.findall(r"\]\((docs/[\w.]+|examples/\w+)\)", text):
        assert (REPO / doc).exists(), doc
    quickstart = [b for b in blocks(README) if b.heading == "Quickstart" and b.marker is None]
    tasks = next(b.source for b in quickstart if "@guarded_task" in b.source)
    commands = next(b.source for b in quickstart if "taskguard db upgrade" in b.source)
    assert len(tasks.strip().splitlines()) <= 15
    assert len(tasks.strip().splitlines()) + len(commands.strip().splitlines()) <= 20
