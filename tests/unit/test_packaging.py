"""Packaging: the wheel's explicit package list (needed to ship migrations/ as
taskguard.migrations) names every subpackage on disk. (The README's install line,
run in a fresh virtualenv before its Quickstart: tests/journey/test_install.py.)"""

from __future__ import annotations

import tomllib
from pathlib import Path

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


def test_minimums_are_declared_for_every_runtime_dependency() -> None:
    """scripts/min_versions.sh tests these lower bounds: each must be there."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for req in project["dependencies"]:
        assert ">=" in req, f"{req}: declare the lowest supported version"
