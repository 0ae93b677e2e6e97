#!/usr/bin/env python3
"""Run celery-once's or celery-singleton's own test suite against taskguard's
backend (issue 30).

    python scripts/peer_suites.py PATH [--database sqlite|postgresql|mariadb|URL]
                                       [--their-backend] [-- PYTEST ARGS]

PATH is a checkout of https://github.com/cameronmaske/celery-once or
https://github.com/steinitzu/celery-singleton; its package and tests are used as
they are (nothing of theirs is copied here). The suite runs with pytest in PATH,
with scripts/peer_suites_plugin.py switching the backend by configuration and
answering the tests' few direct Redis calls from ``task_locks``; the summary counts
the tests that called taskguard's backends (counted per test, not assumed), those
switched to taskguard that never called it, those run unchanged (no lock store
involved) and those not applicable (Redis itself), each with its reason. Nothing
taskguard reads is set: no ``TASKGUARD_*`` variable reaches the suite (an inherited
one is removed); the database is named only where the migration guides name it.
``--their-backend`` runs the same suite on the peer's own backend, for comparison.

Needs, besides taskguard's dev extras: ``pip install fakeredis pytest-mock`` (the
suites import them), the local Redis (celery-singleton's broker and, with
``--their-backend``, its lock store: database 9 of redis://127.0.0.1:6379, flushed
first) and, for ``--database postgresql`` / ``mariadb``, the local servers (a
scratch database is created, migrated and dropped). Without ``--database``: a
migrated SQLite file in a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
REDIS_URL = os.environ.get("PEER_SUITES_REDIS_URL", "redis://127.0.0.1:6379/9")
#: Passed to pytest per suite: the suite's own options minus coverage (not installed).
SUITES = {
    "celery_once": [
        "-o",
        "addopts=",
        # Flask-integration tests: their pytest.ini deselects them (-m "not framework").
        "--ignore=tests/integration/flask_app",
    ],
    "celery_singleton": ["-o", "addopts=", "-p", "celery.contrib.pytest"],
}


@contextlib.contextmanager
def scratch_database(kind: str) -> Iterator[str]:
    """A migrated database of ``kind`` (or the URL given), dropped afterwards."""
    from taskguard import schema

    if "://" in kind:
        schema.upgrade(kind)
        yield kind
        return
    if kind == "sqlite":
        with tempfile.TemporaryDirectory(prefix="tg-peer-") as tmp:
            url = f"sqlite:///{tmp}/locks.sqlite"
            schema.upgrade(url)
            yield url
        return
    sys.path.insert(0, str(REPO))
    from tests import services  # the test suite's scratch databases

    create, drop = {
        "postgresql": (services.new_pg_database, services.drop_pg_database),
        "mariadb": (services.new_maria_database, services.drop_maria_database),
    }[kind]
    url = create("tgpeer")
    try:
        schema.upgrade(url)
        yield url
    finally:
        drop(url)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Everything after "--" goes to pytest as it is (argparse would read it as PATH's).
    split = argv.index("--") if "--" in argv else len(argv)
    own, pytest_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a checkout of celery-once or celery-singleton")
    parser.add_argument("--database", default="sqlite", help="sqlite, postgresql, mariadb or a URL")
    parser.add_argument("--their-backend", action="store_true", help="the peer's own backend")
    args = parser.parse_args(own)
    path = args.path.resolve()
    suite = next((name for name in SUITES if (path / name).is_dir()), None)
    if suite is None:
        parser.error(f"{path} holds neither celery_once/ nor celery_singleton/")
    missing = [m for m in ("fakeredis", "pytest_mock") if importlib.util.find_spec(m) is None]
    if missing:
        parser.error(f"the suites import {', '.join(missing)}: pip install fakeredis pytest-mock")

    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()  # only the suite's own database
    with scratch_database(args.database) as url:
        # Only the guides' configuration names the database (the plugin puts this URL
        # in ONCE / singleton_backend_url): nothing taskguard itself reads is set.
        env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGUARD_")}
        env.update(
            PEER_BACKEND="theirs" if args.their_backend else "taskguard",
            PEER_DATABASE_URL=url,
            CELERY_SINGLETON_TEST_REDIS_URL=REDIS_URL,
            PYTHONPATH=os.pathsep.join(p for p in (str(SCRIPTS), env.get("PYTHONPATH")) if p),
        )
        cmd = [sys.executable, "-m", "pytest", "-p", "peer_suites_plugin", "-p", "no:django"]
        cmd += ["-p", "no:cacheprovider", "-rfEs", *SUITES[suite], *pytest_args]
        print(f"$ cd {path} && {' '.join(cmd)}   # locks in {url}", flush=True)
        return subprocess.run(cmd, cwd=path, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
