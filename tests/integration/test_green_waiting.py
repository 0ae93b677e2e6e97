"""``acquire(..., wait=)`` in a gevent or eventlet process (issue 41, defect 5): while a
waiter LISTENs for the release, the hub keeps running the process's other greenlets
(under eventlet psycopg's C wait used to stop them all for each nap of the waiter),
and the release wakes the waiter."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

import MySQLdb
import psycopg
import pytest
from sqlalchemy.engine import make_url

pytestmark = pytest.mark.postgres

SCRIPT = """
import sys, time
library, url = sys.argv[1], sys.argv[2]
if library == "eventlet":
    import eventlet
    eventlet.monkey_patch()
    spawn, sleep, result = eventlet.spawn, eventlet.sleep, lambda g: g.wait()
else:
    from gevent import monkey
    monkey.patch_all()
    import gevent
    spawn, sleep, result = gevent.spawn, gevent.sleep, lambda g: g.get()
from taskguard import TaskGuard

guard = TaskGuard(url)
held = guard.acquire("green", 30)
ticks = []

def tick():
    while True:
        sleep(0.01)
        ticks.append(time.monotonic())

spawn(tick)
waiter = spawn(guard.acquire, "green", 30, wait=20)
sleep(0.5)
began = time.monotonic()
sleep(2.0)  # the waiter listens for the release
during = sum(began <= t < began + 2.0 for t in ticks)
released = time.monotonic()
guard.release(held)
lease = result(waiter)
print(during, round(time.monotonic() - released, 3), lease is not None)
"""


@pytest.mark.parametrize("library", ["eventlet", "gevent"])
def test_a_waiter_lets_the_other_greenlets_run(pg_url: str, library: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, library, pg_url],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    during, handed_over, granted = out.stdout.split()
    print(f"{library}: {during} ticks of 10 ms in 2 s of waiting; granted {handed_over}s after")
    # Up to 200 ticks; a waiter that blocks the hub leaves a handful.
    assert int(during) >= 50, out.stdout
    assert granted == "True" and float(handed_over) < 2.0, out.stdout


DEADLINE_SCRIPT = """
import sys, time
library, url = sys.argv[1], sys.argv[2]
if library == "eventlet":
    import eventlet
    eventlet.monkey_patch()
else:
    from gevent import monkey
    monkey.patch_all()
from taskguard import TaskGuard, TaskGuardError
from taskguard.deadline import call_limit

guard = TaskGuard(url)
guard.release(guard.acquire("warm-up", 30))
print("ready", flush=True)
sys.stdin.readline()  # the table is locked now
began = time.monotonic()
try:
    with call_limit(1.0):
        guard.acquire("stuck", 30)
    print("granted", round(time.monotonic() - began, 3))
except TaskGuardError as exc:
    print(type(exc).__name__, round(time.monotonic() - began, 3))
"""


@contextlib.contextmanager
def _table_locked(store: str, url: str) -> Iterator[None]:
    """The lock table locked by another session (statements on it wait) until exit."""
    if store == "postgresql":
        with psycopg.connect(url.replace("+psycopg", "")) as conn:
            conn.execute("LOCK TABLE task_locks IN ACCESS EXCLUSIVE MODE")
            yield
        return
    parsed = make_url(url)
    conn = MySQLdb.connect(host=parsed.host, port=parsed.port or 3306, user=parsed.username,
                           password=parsed.password or "", database=parsed.database)  # fmt: skip
    try:
        conn.cursor().execute("LOCK TABLES task_locks WRITE")
        yield
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("library", "store"),
    [("eventlet", "postgresql"), ("gevent", "postgresql"), ("eventlet", "mariadb-pymysql")],
)
def test_the_watchdog_cuts_a_hung_statement(
    request: pytest.FixtureRequest, library: str, store: str
) -> None:
    """The statement watchdog is a greenlet there too: it runs while a statement
    waits (on MariaDB through PyMySQL, whose waits are the patched sockets'), and
    shuts the overdue socket down."""
    if store == "postgresql":
        url = request.getfixturevalue("pg_url")
    else:
        maria = make_url(request.getfixturevalue("maria_url"))
        url = maria.set(drivername="mysql+pymysql").render_as_string(hide_password=False)
    proc = subprocess.Popen(
        [sys.executable, "-c", DEADLINE_SCRIPT, library, url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=30)
        with _table_locked(store, url):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    print(f"{library}/{store}: {out.strip()}")
    outcome, took = out.split()
    assert outcome in ("OutcomeUnknown", "DatabaseUnavailable"), err[-3000:]
    assert float(took) < 1.0 + 3.0, out


def test_mysqlclient_in_a_green_process_is_warned_about(maria_url: str) -> None:
    """mysqlclient waits in C: the event loop stops for each statement and the
    watchdog cannot cut a hung one (it hung past 20 s where PyMySQL ended in 1 s)."""
    script = (
        "import sys, logging\nfrom gevent import monkey\nmonkey.patch_all()\n"
        "logging.basicConfig()\nfrom taskguard import TaskGuard\n"
        "guard = TaskGuard(sys.argv[1])\nguard.release(guard.acquire('k', 30))\n"
    )
    assert make_url(maria_url).get_driver_name() == "mysqldb", maria_url
    out = subprocess.run(
        [sys.executable, "-c", script, maria_url],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "mysqlclient blocks the gevent event loop" in out.stderr, out.stderr
    assert "use a mysql+pymysql:// URL" in out.stderr, out.stderr
