"""Start and stop real ``celery worker`` processes for integration tests.

    from workers import start_worker            # from tests in this directory
    # elsewhere under tests/ (tests/ is on sys.path through tests/conftest.py):
    from integration.celery.workers import start_worker

    with start_worker("my_app_module", broker_url, db_url, queue="q-123") as worker:
        ...                       # worker.log_text(), worker.kill(), worker.pid

The worker is ``python -m celery -A <app_module> worker -P <pool> -c <n>`` with
heartbeat, gossip and mingle off, consuming only ``queue``, in its own process
group (so stopping it also ends its pool children). ``--broker`` and
``--result-backend`` are passed on the command line; the app module also gets
``TASKGUARD_DATABASE_URL``, ``TASKGUARD_TEST_BROKER_URL``,
``TASKGUARD_TEST_RESULT_BACKEND`` and ``TASKGUARD_TEST_QUEUE`` in its
environment. The context manager waits for "ready", and always stops the worker
on exit (warm shutdown, then SIGKILL of the group), also when the test failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kombu import Connection

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]

#: How long a worker may take to report "ready" on a loaded 2-core machine.
START_TIMEOUT = 90.0
#: How long a warm shutdown may take before the group is killed.
STOP_TIMEOUT = 20.0


def worker_settings(
    broker_url: str, result_backend: str | None, queue: str, database_url: str, **more: Any
) -> dict[str, Any]:
    """The settings every test worker app shares (one message at a time per pool
    process, its own queue and lock database), plus ``more``."""
    return {
        "broker_url": broker_url,
        "result_backend": result_backend,
        "task_default_queue": queue,
        "result_expires": 600,
        "worker_prefetch_multiplier": 1,
        "broker_connection_retry_on_startup": True,
        "taskguard_database_url": database_url,
        **more,
    }


def unique_queue(prefix: str = "tg") -> str:
    """A queue name no earlier run can have left messages in."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def purge_queue(broker_url: str, queue: str, *, delete: bool = False) -> int:
    """Remove the messages (and with ``delete`` the queue itself) of ``queue``."""
    with Connection(broker_url, connect_timeout=10) as conn:
        channel = conn.channel()
        try:
            count = 0
            with contextlib.suppress(Exception):  # a queue that does not exist yet
                count = int(channel.queue_purge(queue) or 0)
            if delete:
                channel = conn.channel()
                with contextlib.suppress(Exception):
                    channel.queue_delete(queue)
            return count
        finally:
            with contextlib.suppress(Exception):
                channel.close()


class Worker:
    """A running ``celery worker`` process group."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, queue: str) -> None:
        self.proc = proc
        self.log_path = log_path
        self.queue = queue

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        """Everything the worker (and its pool children) logged so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, text: str, timeout: float) -> None:
        """Wait until ``text`` appears in the log (AssertionError with the log tail if not)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log_text():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(
            f"worker log has no {text!r} (exit code {self.proc.poll()}):\n{self.log_text()[-4000:]}"
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the worker's whole process group (main process and children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Warm shutdown; SIGKILL to the group if it does not finish in time."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT)
        # Pool children can outlive a main process that died: end the group either way.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def start_worker(
    app_module: str,
    broker_url: str,
    db_url: str,
    concurrency: int = 4,
    pool: str = "prefork",
    *,
    queue: str | None = None,
    result_backend: str | None = None,
    pythonpath: Sequence[str | Path] = (HERE, TESTS),
    env: dict[str, str] | None = None,
    loglevel: str = "INFO",
    extra_args: Sequence[str] = (),
    purge: bool = True,
) -> Iterator[Worker]:
    """Run a real worker for ``app_module`` until the block exits (see module doc)."""
    queue = queue or unique_queue()
    if purge:
        purge_queue(broker_url, queue)
    log_dir = Path(tempfile.mkdtemp(prefix="tg-worker-"))
    log_path = log_dir / "worker.log"
    child_env = dict(os.environ)
    child_env.update(
        {
            "TASKGUARD_DATABASE_URL": db_url,
            "TASKGUARD_TEST_BROKER_URL": broker_url,
            "TASKGUARD_TEST_RESULT_BACKEND": result_backend or "",
            "TASKGUARD_TEST_QUEUE": queue,
            "PYTHONPATH": os.pathsep.join(
                [*(str(p) for p in pythonpath), child_env.get("PYTHONPATH", "")]
            ),
        }
    )
    child_env.update(env or {})
    cmd = [sys.executable, "-m", "celery", "-A", app_module, "--broker", broker_url]
    if result_backend:
        cmd += ["--result-backend", result_backend]
    cmd += [
        "worker",
        "-P",
        pool,
        "-c",
        str(concurrency),
        "--without-heartbeat",
        "--without-gossip",
        "--without-mingle",
        "-Q",
        queue,
        "-n",
        f"{queue}@%h",
        "-l",
        loglevel,
        "-f",
        str(log_path),
        *extra_args,
    ]
    with open(log_dir / "stdout.log", "wb") as out:
        proc = subprocess.Popen(
            cmd, env=child_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    worker = Worker(proc, log_path, queue)
    failed = True
    try:
        try:
            worker.wait_for_log(" ready.", START_TIMEOUT)
        except AssertionError as exc:
            stdout = (log_dir / "stdout.log").read_text(errors="replace")[-4000:]
            raise AssertionError(f"{exc}\nstdout/stderr:\n{stdout}\n(logs in {log_dir})") from None
        yield worker
        failed = False
    finally:
        worker.stop()
        if purge:
            with contextlib.suppress(Exception):
                purge_queue(broker_url, queue, delete=True)
        if not failed and not os.environ.get("TG_KEEP_LOGS"):  # keep a failed test's logs
            shutil.rmtree(log_dir, ignore_errors=True)
