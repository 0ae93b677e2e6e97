"""Running the ``taskguard`` command line and ``celery -A … taskguard`` as real
processes against real databases, for the test_cli* modules. Every invocation
goes through ``run()``, which also checks that the database password never
appears in any output. Import the fixtures into a test module
(``from cli_runner import env, guard, ...``).

``taskguard …`` runs in a child forked from the test's process (``_forked``): a
process of its own (environment, working directory, stdin, stdout, stderr, exit
code, logging and warnings as a fresh interpreter has them), without a new
interpreter importing taskguard again (1.4 s of CPU per command, ~150 commands in
these modules). The console script itself is run by the journeys and tests/docs.
"""

from __future__ import annotations

import contextlib
import gc
import io
import locale
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import MySQLdb
import pytest
from sqlalchemy.engine import make_url

from taskguard import TaskGuard
from taskguard.cli import main

TESTS_DIR = Path(__file__).resolve().parents[1]
PASSWORD = "s3cr3t-Pa55"  # PostgreSQL trust auth ignores it; it must never be printed

_script = shutil.which("taskguard", path=str(Path(sys.executable).parent)) or shutil.which(
    "taskguard"
)
TASKGUARD = (
    [_script] if _script else [sys.executable, "-c", "from taskguard.cli import main; main()"]
)
CELERY = [sys.executable, "-m", "celery", "-A", "ops_app", "taskguard"]


def with_password(url: str) -> str:
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def run(
    argv: list[str], env: dict[str, str], input: str | None = None, code: int = 0
) -> subprocess.CompletedProcess[str]:
    if argv[: len(TASKGUARD)] == TASKGUARD:
        proc = _forked(argv[len(TASKGUARD) :], env, input or "")
    else:
        proc = subprocess.run(
            argv,
            env=env,
            input=input if input is not None else "",
            capture_output=True,
            text=True,
            timeout=60,
            cwd=TESTS_DIR,
            check=False,
        )
    both = proc.stdout + proc.stderr
    assert PASSWORD not in both, both
    assert proc.returncode == code, f"exit {proc.returncode}, wanted {code}\n{both}"
    if code != 0:
        # The error is one line, prefixed, on stderr (after a confirmation prompt, if any).
        lines = proc.stderr.splitlines()
        assert proc.stderr.endswith("\n"), proc.stderr
        assert lines[-1].startswith("taskguard: "), proc.stderr
        # (click < 8.2 writes the prompt's last space to stdout, hence the rstrip)
        assert len(lines) == 1 or (len(lines) == 2 and lines[0].rstrip().endswith("[y/N]:")), (
            proc.stderr
        )
    return proc


def _forked(args: list[str], env: dict[str, str], input: str) -> subprocess.CompletedProcess[str]:
    """``taskguard *args`` in a forked child (see the module's doc)."""
    encoding = locale.getpreferredencoding(False)
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(3)]
        files[0].write(input.encode(encoding))  # stdin, stdout, stderr
        files[0].seek(0)
        pid = os.fork()
        if pid == 0:
            _child(files, encoding, env, args)  # never returns
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"taskguard {args} did not finish within 60 s")
            time.sleep(0.01)
        out, err = (_read(f, encoding) for f in files[1:])
    return subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(done[1]), out, err)


def _child(files: list[Any], encoding: str, env: dict[str, str], args: list[str]) -> None:
    status = 1
    try:
        gc.disable()  # no finalizer of the parent's objects runs here
        for fd, file in enumerate(files):
            os.dup2(file.fileno(), fd)
        sys.stdin = open(0, encoding=encoding, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", encoding=encoding, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding=encoding, errors="backslashreplace", closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        os.chdir(TESTS_DIR)
        _fresh_logging_and_warnings()
        try:
            main(args)
            status = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                status = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _read(file: Any, encoding: str) -> str:
    file.seek(0)
    return io.TextIOWrapper(file, encoding=encoding, errors="replace").read()


def _fresh_logging_and_warnings() -> None:
    """Logging and warnings as a new interpreter starts with them (pytest's capture
    handlers and recorders are the parent's)."""
    logging.disable(logging.NOTSET)
    for logger in [logging.root, *logging.Logger.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger):
            logger.handlers.clear()
            logger.setLevel(logging.NOTSET)
            logger.propagate, logger.disabled = True, False
    logging.root.setLevel(logging.WARNING)
    warnings.resetwarnings()  # then Python's default filters, last to first
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    warnings.showwarning = _show_warning


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKGUARD_", "OPS_APP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(params=["postgresql", "mariadb"])
def lock_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test's database, as a role that has a password (it must never be printed)."""
    if request.param == "postgresql":
        yield str(request.getfixturevalue("pg_url"))
        return
    plain = make_url(str(request.getfixturevalue("maria_url")))
    user = f"tg_cli_{plain.database}"[:32]
    admin = MySQLdb.connect(host=plain.host, port=plain.port, user="root", autocommit=True)
    cur = admin.cursor()
    cur.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{PASSWORD}'")
    cur.execute(f"GRANT ALL ON `{plain.database}`.* TO '{user}'@'%'")
    yield plain.set(username=user).render_as_string(hide_password=False)
    cur.execute(f"DROP USER '{user}'@'%'")
    admin.close()


@pytest.fixture
def url(lock_url: str) -> str:
    return with_password(lock_url)


@pytest.fixture
def env(url: str) -> dict[str, str]:
    return {**base_env(), "TASKGUARD_DATABASE_URL": url}


@pytest.fixture
def guard(url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(url)
    yield g
    g.dispose()


def tg(*args: str, env: dict[str, str], input: str | None = None, code: int = 0) -> str:
    return run([*TASKGUARD, *args], env, input, code).stdout
