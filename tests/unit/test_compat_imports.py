"""taskguard does not depend on celery-once or celery-singleton: ``taskguard.compat``
and the singleton backend import neither, the celery-once backend imports only
celery-once (for ``AlreadyQueued``). Each case in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys


def _loaded_after(statement: str) -> list[str]:
    peers = "('celery_once', 'celery_singleton')"
    code = (
        f"import json, sys\n{statement}\n"
        f"print(json.dumps(sorted(m for m in {peers} if m in sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return list(json.loads(proc.stdout))


def test_the_package_and_the_singleton_backend_import_no_peer() -> None:
    assert _loaded_after("import taskguard, taskguard.compat") == []
    assert _loaded_after("import taskguard.compat.celery_singleton") == []


def test_the_once_backend_imports_only_celery_once() -> None:
    assert _loaded_after("import taskguard.compat.celery_once") == ["celery_once"]
