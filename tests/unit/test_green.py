"""Green processes (issue 41, defect 5): taskguard tells a gevent or eventlet process
from a plain one, and there makes psycopg wait through the patched selectors (its
C wait would stop every greenlet); a plain process keeps psycopg's own choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
if sys.argv[1] == "eventlet":
    import eventlet
    eventlet.monkey_patch()
elif sys.argv[1] == "gevent":
    from gevent import monkey
    monkey.patch_all()
import psycopg.waiting
from taskguard.dialects.postgresql_connections import wait_cooperatively
from taskguard.green import green_library
before = psycopg.waiting.wait.__name__
wait_cooperatively()
print(green_library(), before, psycopg.waiting.wait.__name__)
"""


@pytest.mark.parametrize("library", ["plain", "gevent", "eventlet"])
def test_psycopg_waits_through_the_event_loop_in_a_green_process(library: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PSYCOPG_WAIT_FUNC"}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", SCRIPT, library],
        capture_output=True, text=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    green, before, after = out.stdout.split()
    assert green == ("None" if library == "plain" else library), out.stdout
    if library == "eventlet":
        assert (before, after) == ("wait_c", "wait_selector"), out.stdout
    else:  # psycopg's own choice (under gevent it saw the patched select at import)
        assert before == after and (library == "plain" or after != "wait_c"), out.stdout
