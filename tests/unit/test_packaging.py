"""Packaging: the wheel's explicit package list (needed to ship migrations/ as
taskguard.migrations) names every subpackage on disk, and the README's install line
gives its Quickstart what it imports."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_every_subpackage_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "taskguard").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages"
    assert config["package-dir"]["taskguard.migrations"] == "migrations"
    assert (REPO / "migrations" / "versions" / "__init__.py").is_file()


def _readme_install_line() -> str:
    """The Quickstart's own install command (a ```bash block that is only that)."""
    import re

    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    found = [b.strip() for b in blocks if b.strip().startswith('pip install "taskguard')]
    assert len(found) == 1, "README.md's Quickstart needs one ```bash block: pip install taskguard…"
    return found[0]


def test_minimums_are_declared_for_every_runtime_dependency() -> None:
    """scripts/min_versions.sh tests these lower bounds: each must be there."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for req in project["dependencies"]:
        assert ">=" in req, f"{req}: declare the lowest supported version"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_install_line_makes_the_quickstart_broker_work(tmp_path: Path) -> None:
    """The README's install line, run for real in a clean venv (dependencies from the
    package index, as a user gets them), gives the Quickstart's app a working Redis
    broker and result backend (kombu's Redis transport and its imports)."""
    import re
    import shlex

    from conftest import REDIS_URL

    argv = shlex.split(_readme_install_line())
    assert argv[:2] == ["pip", "install"] and len(argv) == 3, argv
    extras = re.fullmatch(r"taskguard(\[[\w,]+\])?", argv[2])
    assert extras, argv
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(REPO)],
        check=True,
    )  # fmt: skip
    wheel = next(dist.glob("taskguard-*.whl"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = str(env_dir / "bin" / "python")
    # The same command as the README's, with the built wheel in place of the index's taskguard.
    subprocess.run(
        [py, "-m", "pip", "install", "-q", f"{wheel}{extras.group(1) or ''}"],
        check=True,
        cwd=tmp_path,
    )
    quickstart = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    [tasks] = [b for b in quickstart if "@guarded_task" in b]
    for readme_url in ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/1"):
        assert readme_url in tasks, "the Quickstart's Redis URLs changed; update this test"
        tasks = tasks.replace(readme_url, REDIS_URL)
    (tmp_path / "tasks.py").write_text(tasks)
    check = (
        "import tasks\n"
        "with tasks.app.connection_for_write() as conn:\n"
        "    conn.ensure_connection(max_retries=1)\n"
        "    print(conn.transport.__module__)\n"
        "print(tasks.app.backend.client.ping())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TASKGUARD_"))}
    done = subprocess.run(
        [py, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["kombu.transport.redis", "True"], done.stdout
