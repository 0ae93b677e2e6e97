"""Run the test Django project (``project/``) in subprocesses, one per command, so
Django's settings never leak into the other tests of this pytest process.

    site = DjangoSite.for_database("postgresql", name="tg_ab12", pg_url=PG_URL)
    site.manage("migrate")          # CompletedProcess, check=True by default
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT = Path(__file__).resolve().parent / "project"
REPO = Path(__file__).resolve().parents[3]


@dataclass
class DjangoSite:
    """One configuration of the test project (database engine and name)."""

    db: str
    name: str
    pg_url: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("TASKGUARD_DATABASE_URL", None)  # the project's settings must decide
        env.update(
            {
                "DJANGO_SETTINGS_MODULE": "tgsite.settings",
                "TG_DJANGO_DB": self.db,
                "TG_DJANGO_NAME": self.name,
                "TG_DJANGO_PG_URL": self.pg_url,
                "TG_DJANGO_EXTRA": json.dumps(self.extra),
                "PYTHONPATH": os.pathsep.join([str(PROJECT), str(REPO), env.get("PYTHONPATH", "")]),
            }
        )
        return env

    def manage(
        self, *args: str, check: bool = True, timeout: float = 240.0
    ) -> subprocess.CompletedProcess[str]:
        """``python manage.py ARGS`` in the project; raises with the output on failure."""
        return run([sys.executable, "manage.py", *args], self.env(), check=check, timeout=timeout)


def run(
    cmd: Sequence[str], env: dict[str, str], *, check: bool = True, timeout: float = 240.0
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(cmd), cwd=PROJECT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
            f"stderr:\n{proc.stderr[-6000:]}"
        )
    return proc
