"""Under pytest-django the locks follow the test database too: a user's pytest run
(a subprocess, with pytest-django on and the test project's settings) takes a lock
through the Celery app's guard and finds it with the ORM, in the test database."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from djangoproject import PROJECT, DjangoSite
from test_django_project import empty_site  # noqa: F401  (the fixture, per database)

USER_TEST = textwrap.dedent(
    """
    import pytest
    from django.db import connection
    from sqlalchemy.engine import make_url

    from taskguard.config import guard_for
    from taskguard.contrib.django.models import HeldLock


    @pytest.mark.django_db(transaction=True)
    def test_locks_follow_the_test_database():
        from tgsite.celery import app

        name = str(connection.settings_dict["NAME"])
        assert "test" in name
        assert str(make_url(str(app.conf.taskguard_database_url)).database).endswith(name)
        guard = guard_for(app)
        lease = guard.acquire("pytest-django:1", ttl=30)
        assert HeldLock.objects.filter(key="pytest-django:1").count() == 1
        guard.release(lease)
    """
)


def test_locks_follow_the_test_database_under_pytest_django(
    empty_site: DjangoSite,  # noqa: F811
    tmp_path: Path,
) -> None:
    (tmp_path / "test_user.py").write_text(USER_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nDJANGO_SETTINGS_MODULE = tgsite.settings\n")
    env = empty_site.env()
    env.pop("DJANGO_SETTINGS_MODULE")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "pytest_django", "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": f"{PROJECT}:{env['PYTHONPATH']}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout
