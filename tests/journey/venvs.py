"""A newcomer's machine: a fresh checkout of the repository (its committed and
untracked-but-not-ignored files, as ``git clone`` plus local edits would give) and
fresh virtualenvs in which the docs' own ``pip install`` lines run, dependencies
from the package index as pip finds them (nothing from the test environment)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from tests.docs import runner

REPO = Path(__file__).resolve().parents[2]
#: Environment variables of the test run that a newcomer's shell would not have: a
#: docs reader's, and not the test run's virtualenv or pytest options either.
NOT_INHERITED = (*runner.NOT_INHERITED, "VIRTUAL_ENV", "PYTEST_ADDOPTS")


def checkout(dest: Path) -> Path:
    """Copy the repository's files (not its venvs, caches or build output) to ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = REPO / rel
        if not src.is_file():  # deleted in the work tree
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    return dest


class UserVenv:
    """A fresh virtualenv; ``run`` runs a shell command in it (activated, as a user
    who followed ``python -m venv`` and ``. bin/activate`` would)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        venv.EnvBuilder(with_pip=True, clear=True).create(path)
        self.bin = path / "bin"
        self.python = self.bin / "python"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        # This test run's own venv off PATH: only the new one's commands are found.
        own = str(Path(sys.executable).parent)
        path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != own]
        env["PATH"] = os.pathsep.join([str(self.bin), *path])
        env["VIRTUAL_ENV"] = str(self.path)
        env.update(extra)
        return env

    def run(
        self, command: str, cwd: Path, timeout: float = 600, **extra: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=self.env(**extra),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def must(self, command: str, cwd: Path, timeout: float = 600, **extra: str) -> str:
        done = self.run(command, cwd, timeout, **extra)
        assert done.returncode == 0, (
            f"`{command}` exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
        return done.stdout

    def installed_from(self, module: str, cwd: Path) -> str:
        """Where ``module`` is imported from in this venv."""
        return self.must(f"python -c 'import {module}; print({module}.__file__)'", cwd).strip()
