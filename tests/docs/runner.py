"""Run a page's blocks as a reader would, on private services.

A :class:`Page` is one reader's session with one page: a fresh directory (the
reader's project), a Python session for the page's python blocks (tests/docs/child.py),
a shell for its commands, and the services its URLs name. The URLs written on the
page are rewritten to private ones by the page's mapping (tests/docs/pages.py), in
the blocks before they run and back in their output before it is compared: the
only change made to what the page says.

Commands run with ``bash -c`` in the page's directory, with this Python's
``bin`` first on ``PATH`` (so ``taskguard``, ``celery`` and ``alembic`` are the
tested ones), without ``TASKGUARD_DATABASE_URL`` from the outside, and with
``CELERY_WORKER_LOGLEVEL=INFO`` (so a worker says when it is ready; Celery's
option, set through its environment). A ``celery ... worker`` command is started
in the background; the page's later blocks run while it does, and it is stopped
when the page is closed (or fails when it exits early).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sqlalchemy.engine import make_url

from tests import services
from tests.docs.blocks import REPO, Block

CHILD = Path(__file__).with_name("child.py")
#: Environment variables of the test run that a reader's shell would not have.
NOT_INHERITED = (
    "TASKGUARD_DATABASE_URL",
    "TASKGUARD_LOCKING",
    "TASKGUARD_TEST_SERVER",
    "DJANGO_SETTINGS_MODULE",
    "PYTHONPATH",
)
#: Commands that keep running: started in the background, ready when this is printed.
BACKGROUND = {re.compile(r"^celery\s.*\bworker\b"): re.compile(r"\bready\.")}
START_TIMEOUT = 90.0


@dataclass(frozen=True)
class Service:
    """What a URL on a page is rewritten to.

    ``pg``: an empty PostgreSQL database; ``pg+schema``: one with taskguard's
    tables; ``maria`` / ``maria+schema`` likewise on MariaDB; ``redis``: database
    ``db`` of the test Redis server, emptied. Each page gets databases of its own.
    """

    kind: str
    db: int = 0


@dataclass(frozen=True)
class PageSpec:
    """How a page runs: its URL mapping, scenarios and checks (tests/docs/pages.py)."""

    urls: dict[str, Service] = field(default_factory=dict)
    #: scenario name -> the headings (prefixes) whose blocks it runs, in page order.
    #: A page without scenarios runs every block once, top to bottom.
    scenarios: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: The database ``sql`` blocks run on (PostgreSQL, through psql): a service of its
    #: own, or the page URL (a key of ``urls``) whose database it is.
    sql: Service | str | None = None
    #: Called once the services exist, before the first block.
    setup: Callable[[Page], None] | None = None
    #: A text found in exactly one block -> a check of that block's output.
    checks: dict[str, Callable[[Page, str], None]] = field(default_factory=dict)
    timeout: float = 120.0
    #: A journey (a test file) that runs each scenario's blocks, and what follows them
    #: in a deploy: the page is not collected on its own as well.
    run_by: str = ""

    def includes(self, scenario: str, heading: str) -> bool:
        if not self.scenarios:
            return True
        return any(heading.startswith(h) for h in self.scenarios[scenario])


class BlockFailed(AssertionError):
    pass


class Page:
    """One reader's session with one page (see the module doc)."""

    def __init__(
        self,
        page: Path,
        spec: PageSpec,
        scenario: str = "",
        python: Path | None = None,
        directory: Path | None = None,
    ) -> None:
        self.page = page
        #: The reader's Python (its bin directory comes first on PATH): this test
        #: run's own unless a journey passes a fresh virtualenv's.
        self.python_exe = python or Path(sys.executable)
        self.spec = spec
        self.scenario = scenario
        self.base = Path(tempfile.mkdtemp(prefix="tgdocs-"))
        #: The reader's directory: a fresh one, or (a journey's) an example's in a checkout.
        self.dir = directory or self.base / "project"
        self.dir.mkdir(exist_ok=True)
        self.urls: dict[str, str] = {}  # page URL -> test URL
        self._cleanups: list[Callable[[], None]] = []
        self._background: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self._python: subprocess.Popen[str] | None = None
        self._replies: IO[str] | None = None
        self.failed: str | None = None
        self.outputs: dict[str, str] = {}  # block name -> output, for checks
        self.notes: dict[str, Any] = {}  # what a page's setup leaves for its checks
        self.sql_url: str | None = None

    # -- life cycle -------------------------------------------------------------------

    def open(self) -> Page:
        try:
            for page_url, service in self.spec.urls.items():
                self.urls[page_url] = self._provide(page_url, service)
            if isinstance(self.spec.sql, str):
                self.sql_url = self.urls[self.spec.sql]
            elif self.spec.sql is not None:
                self.sql_url = self._provide("", self.spec.sql)
            if self.spec.setup is not None:
                self.spec.setup(self)
        except BaseException:
            self.close()
            raise
        return self

    def _provide(self, page_url: str, service: Service) -> str:
        page = make_url(page_url) if "://" in page_url else None
        if service.kind.startswith(("pg", "maria")):
            if service.kind.startswith("pg"):
                url = services.new_pg_database()
                self._cleanups.append(lambda: services.drop_pg_database(url))
            else:
                url = services.new_maria_database()
                self._cleanups.append(lambda: services.drop_maria_database(url))
            if service.kind.endswith("+schema"):
                from taskguard import schema

                schema.upgrade(url)
            test = make_url(url)
            if page is not None:  # the page's driver and options, the test's server
                test = test.set(drivername=page.drivername, query=page.query)
            return test.render_as_string(hide_password=False)
        if service.kind == "redis":
            return services.redis_db(service.db)
        raise ValueError(f"unknown service kind {service.kind!r}")

    def stop_background(self) -> None:
        """Stop what the page started in the background (workers)."""
        for _, proc, _ in reversed(self._background):
            _stop(proc)
        self._background.clear()

    def close(self) -> None:
        self.stop_background()
        if self._python is not None:
            with contextlib.suppress(Exception):
                assert self._python.stdin is not None
                self._python.stdin.close()
            _stop(self._python)
            self._python = None
        if self._replies is not None:
            self._replies.close()
            self._replies = None
        while self._cleanups:
            with contextlib.suppress(Exception):
                self._cleanups.pop()()
        shutil.rmtree(self.base, ignore_errors=True)

    # -- URL mapping ------------------------------------------------------------------

    def map(self, text: str) -> str:
        """The page's URLs replaced by the test's."""
        for page_url in sorted(self.urls, key=len, reverse=True):
            text = re.sub(re.escape(page_url) + r"(?![\w-])", self.urls[page_url], text)
        return text

    def unmap(self, text: str) -> str:
        """The test's URLs (as printed) replaced by the page's."""
        pairs = []
        for page_url, test_url in self.urls.items():
            pairs.append((test_url, page_url))
            if "://" in test_url:  # also as printed with the password masked
                masked = make_url(test_url).render_as_string(hide_password=True)
                pairs.append((masked, page_url))
        for test_url, page_url in sorted(pairs, key=lambda p: len(p[0]), reverse=True):
            text = re.sub(re.escape(test_url) + r"(?![\w-])", page_url, text)
        return text

    # -- running blocks -----------------------------------------------------------------

    def run(self, block: Block) -> str:
        """Run one block; its output. Raises BlockFailed with what went wrong."""
        if self.failed is not None:
            raise BlockFailed(f"not run: an earlier block of this page failed ({self.failed})")
        try:
            self._check_background()
            kind = block.kind
            if kind in ("file", "append"):
                out = self._save(block)
            elif kind == "python":
                out = self._python_block(block)
            elif kind == "bash":
                out = "".join(self._command(c, block) for c in commands(block.source))
            elif kind == "console":
                out = self._console(block)
            elif kind == "sql":
                out = self._sql(block)
            else:
                raise BlockFailed(f"{block.name}: a {block.language or 'plain'} block cannot run")
            self.outputs[block.name] = out
            for needle, check in self.spec.checks.items():
                if needle in block.source:
                    check(self, out)
            return out
        except BaseException:
            self.failed = block.name
            raise

    def _save(self, block: Block) -> str:
        file = block.file
        assert file is not None
        target = self.dir / file[0]
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a" if file[1] else "w") as fh:
            fh.write(self.map(block.body))
        return ""

    def _python_block(self, block: Block) -> str:
        # Line numbers in tracebacks are the page's: the source starts below the fence.
        return self.python(self.map(block.source), block.name.split(":")[0], block.line)

    def _start_python(self) -> None:
        read, write = os.pipe()
        with (self.base / "python.log").open("wb") as log:
            self._python = subprocess.Popen(
                [str(self.python_exe), str(CHILD), str(write)],
                cwd=self.dir,
                env=self.env(),
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write,),
                text=True,
                start_new_session=True,
            )
        os.close(write)
        self._replies = os.fdopen(read)

    def python(self, source: str, file: str = "<journey>", line: int = 0) -> str:
        """Run ``source`` in the page's Python session; what it printed."""
        if self._python is None:
            self._start_python()
        assert self._python is not None and self._python.stdin is not None
        assert self._replies is not None
        request = {"source": source, "file": file, "line": line}
        self._python.stdin.write(json.dumps(request) + "\n")
        self._python.stdin.flush()
        reply_line = _read_line(self._replies, self.spec.timeout)
        if reply_line is None:
            raise BlockFailed(
                f"{file}:{line}: no answer within {self.spec.timeout:.0f} s\n{self._logs()}"
            )
        reply = json.loads(reply_line)
        if not reply["ok"]:
            raise BlockFailed(f"{file}:{line} raised:\n{reply['error']}\n{self._logs()}")
        return str(reply["stdout"])

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        own = str(Path(sys.executable).parent)
        path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != own]
        env["PATH"] = os.pathsep.join([str(self.python_exe.parent), *path])
        env["CELERY_WORKER_LOGLEVEL"] = "INFO"
        return env

    def shell(self, command: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``command`` (already mapped) in the page's directory."""
        return subprocess.run(
            ["bash", "-c", command],
            cwd=self.dir,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout or self.spec.timeout,
        )

    def _command(self, command: str, block: Block) -> str:
        mapped = self.map(command)
        for pattern, ready in BACKGROUND.items():
            if pattern.search(command):
                self.start(mapped, ready)
                return ""
        done = self.shell(mapped)
        if done.returncode != 0:
            raise BlockFailed(
                f"{block.name}: `{command}` exited {done.returncode}\n"
                f"{self.unmap(done.stdout)}{self.unmap(done.stderr)}\n{self._logs()}"
            )
        return self.unmap(done.stdout)

    def start(self, command: str, ready: re.Pattern[str]) -> None:
        """Start ``command`` in the background; return once its output matches ``ready``."""
        log_path = self.base / f"background-{len(self._background)}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                ["bash", "-c", command],
                cwd=self.dir,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._background.append((command, proc, log_path))
        deadline = time.monotonic() + START_TIMEOUT
        while not ready.search(log_path.read_text(errors="replace")):
            if proc.poll() is not None:
                raise BlockFailed(
                    f"`{self.unmap(command)}` exited {proc.returncode} at start:\n"
                    + self.unmap(log_path.read_text(errors="replace"))[-4000:]
                )
            if time.monotonic() > deadline:
                raise BlockFailed(f"`{self.unmap(command)}` not ready after {START_TIMEOUT} s")
            time.sleep(0.2)

    def _check_background(self) -> None:
        for command, proc, log_path in self._background:
            if proc.poll() is not None:
                raise BlockFailed(
                    f"`{self.unmap(command)}` (started by an earlier block) exited "
                    f"{proc.returncode}:\n{self.unmap(log_path.read_text(errors='replace'))[-4000:]}"
                )

    def background_command_line(self, index: int = -1) -> str:
        """The running process's command line (what ``bash -c`` executed)."""
        pid = self._background[index][1].pid
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()

    def background_log(self, index: int = -1) -> str:
        return self.unmap(self._background[index][2].read_text(errors="replace"))

    def _console(self, block: Block) -> str:
        out = []
        for command, expected in transcript(block.source):
            got = self._command(command, block)
            out.append(got)
            if _normalized(got) != _normalized("\n".join(expected)):
                raise BlockFailed(
                    f"{block.name}: `$ {command}` printed what the page does not show:\n"
                    f"--- page ---\n" + "\n".join(expected) + f"\n--- printed ---\n{got}"
                )
        return "".join(out)

    def _sql(self, block: Block) -> str:
        if self.sql_url is None:
            raise BlockFailed(f"{block.name}: the page spec names no database for sql blocks")
        url = make_url(self.sql_url).set(drivername="postgresql")
        psql = shutil.which("psql") or "psql"
        done = subprocess.run(
            [psql, "-X", "-v", "ON_ERROR_STOP=1", "-d", url.render_as_string(False), "-f", "-"],
            input=self.map(block.source),
            capture_output=True,
            text=True,
            timeout=self.spec.timeout,
        )
        if done.returncode != 0 or "ERROR" in done.stderr:
            raise BlockFailed(f"{block.name}: psql exited {done.returncode}:\n{done.stderr}")
        return done.stdout

    def _logs(self) -> str:
        parts = []
        python_log = self.base / "python.log"
        if python_log.exists() and python_log.stat().st_size:
            parts.append("--- python session output ---\n" + python_log.read_text()[-3000:])
        for command, _, log_path in self._background:
            text = self.unmap(log_path.read_text(errors="replace"))[-3000:]
            parts.append(f"--- `{self.unmap(command)}` ---\n{text}")
        return "\n".join(parts)


def commands(source: str) -> list[str]:
    """The commands of a bash block: one per line, ``\\``-continued lines joined."""
    out, current = [], ""
    for line in source.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip() and not current.strip().startswith("#"):
            out.append(current.strip())
        current = ""
    return out


def transcript(source: str) -> list[tuple[str, list[str]]]:
    """The ``$ command`` lines of a console block, each with the lines under it."""
    steps: list[tuple[str, list[str]]] = []
    for line in source.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
        elif line.strip():
            raise BlockFailed(f"output before any `$ command`: {line!r}")
    return steps


def _normalized(text: str) -> Counter[str]:
    """Output lines, order-free (``alembic current`` lists heads in any order), blank
    lines dropped, taskguard's revision ids generalized (a new revision must not make
    every transcript wrong)."""
    return Counter(
        re.sub(r"\btg\d{4}\b", "tgNNNN", line.rstrip())
        for line in text.splitlines()
        if line.strip()
    )


def _read_line(stream: IO[str], timeout: float) -> str | None:
    import select

    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else None


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


__all__ = ["REPO", "BlockFailed", "Page", "PageSpec", "Service", "commands", "transcript"]
