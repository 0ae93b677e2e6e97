"""A throwaway PostgreSQL cluster we are allowed to crash.

``initdb`` into a fresh temp dir, started on a free loopback port with its socket
in that dir. Never touches the shared server on 5432. PostgreSQL refuses to run
as root, so when we are root every server binary runs as the ``postgres`` OS
user (the temp dir is handed to it).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from chaoslib.servers import PrivateServer

PG_BIN = Path(os.environ.get("TASKGUARD_PG_BIN", "/usr/lib/postgresql/15/bin"))
_OS_USER = "postgres"


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_server_user(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", _OS_USER, "--", *cmd]


class ThrowawayCluster(PrivateServer):
    """A private PostgreSQL cluster: ``with ThrowawayCluster() as c: c.crash()``.

    ``settings`` are extra ``-c name=value`` server options (e.g. a long
    ``wal_writer_delay`` for the relaxed-durability negative control).
    """

    #: Whether :meth:`freeze` stopped it (and :meth:`thaw` has not resumed it).
    frozen = False

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.settings = {
            "listen_addresses": "127.0.0.1",
            "max_connections": "60",
            "shared_buffers": "32MB",
            **(settings or {}),
        }
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tg-chaos-pg-"))
        self.data = self.dir / "data"
        self.logfile = self.dir / "server.log"
        self.running = False
        self.crashes = 0
        if os.geteuid() == 0:
            pw = pwd.getpwnam(_OS_USER)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run(
            [
                str(PG_BIN / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ]
        )

    # -- lifecycle ---------------------------------------------------------------

    def _run(self, cmd: list[str], timeout: float = 120) -> None:
        proc = subprocess.run(
            _as_server_user(cmd), capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd[:2])} failed ({proc.returncode}): {proc.stderr.strip()}\n"
                f"{self.tail_log()}"
            )

    def _options(self) -> str:
        opts = [f"-p {self.port}", f"-k {self.dir}"]
        opts += [f"-c {k}={v}" for k, v in self.settings.items()]
        return " ".join(opts)

    def start(self) -> None:
        """Start the server (runs crash recovery if it was crashed) and wait for it."""
        self._run(
            [
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.logfile),
                "-w",
                "-t",
                "120",
                "-o",
                self._options(),
                "start",
            ]
        )
        self.running = True
        self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: every server process quits at once, no
        checkpoint, unflushed WAL buffers are lost; the next start runs recovery."""
        self._run([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        self.running = False
        self.crashes += 1

    def crash_restart(self) -> float:
        """Crash, then start again; returns the seconds the server was down."""
        t0 = time.monotonic()
        self.crash()
        self.start()
        return time.monotonic() - t0

    def _postmaster(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    @staticmethod
    def _children(pid: int) -> list[int]:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    def freeze(self) -> None:
        """SIGSTOP every server process: connections stay open and new ones are
        accepted by the kernel, but nothing answers (a hung host)."""
        self.frozen = True
        pid = self._postmaster()
        os.kill(pid, signal.SIGSTOP)  # first: it forks no one meanwhile
        for child in self._children(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT what :meth:`freeze` stopped (it then answers what waited)."""
        pid = self._postmaster()
        for child in self._children(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGCONT)
        os.kill(pid, signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        if self.running:
            self._run([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"])
            self.running = False

    def destroy(self) -> None:
        """Stop (immediately) and delete the cluster's directory."""
        if self.frozen:
            with contextlib.suppress(Exception):
                self.thaw()
        if self.running:
            with contextlib.suppress(Exception):
                self._run(
                    [str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"]
                )
            self.running = False
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- addressing ----------------------------------------------------------------

    def dsn(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def url(self, database: str = "postgres", port: int | None = None) -> str:
        """SQLAlchemy URL; ``port`` lets a client go through a proxy instead."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{port or self.port}/{database}"

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def tail_log(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
