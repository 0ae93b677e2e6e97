"""A Django project that uses taskguard without its app in INSTALLED_APPS."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_PROJECT = """
import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=[], USE_TZ=True,
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": %r}},
)
django.setup()
from taskguard import TaskGuard, TaskGuardError
from taskguard.contrib.django import conf

try:
    TaskGuard(conf.database_url()).acquire("feed:1", 5)
except TaskGuardError as exc:
    print(exc)
"""


def test_the_fix_is_the_app_and_migrate_not_db_upgrade(tmp_path: Path) -> None:
    """Issue 41, defect 8h: the project was told "run `taskguard db upgrade`"."""
    script = _PROJECT % str(tmp_path / "site.sqlite")
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert 'the app "taskguard.contrib.django", which is not in INSTALLED_APPS' in out, out
    assert "add it to INSTALLED_APPS and run `manage.py migrate`" in out, out
    assert "taskguard db upgrade" not in out, out
