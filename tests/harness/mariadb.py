"""A throwaway MariaDB server we are allowed to crash.

``mariadb-install-db`` into a fresh temp dir, ``mariadbd`` started on a free
loopback port with its socket and logs in that dir. Never touches the shared
server on 3306. Same interface as :class:`tests.harness.postgres.ThrowawayCluster`
(start, crash, crash_restart, url, create_database, destroy).

Durability settings are MariaDB's defaults (``innodb_flush_log_at_trx_commit=1``),
stated on the command line so a distribution's my.cnf cannot change them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

from tests.harness.servers import CrashableServer, free_port, private_dir

MARIADBD = os.environ.get("TASKGUARD_MARIADBD", "/usr/sbin/mariadbd")
INSTALL_DB = os.environ.get("TASKGUARD_MARIADB_INSTALL_DB", "/usr/bin/mariadb-install-db")
_OS_USER = "mysql"


def _connect(port: int, database: str | None = None) -> Any:
    import MySQLdb

    return MySQLdb.connect(
        host="127.0.0.1",
        port=port,
        user="root",
        database=database or "",
        autocommit=True,
        connect_timeout=2,
    )


class ThrowawayMariaDB(CrashableServer):
    """A private MariaDB server: ``with ThrowawayMariaDB() as m: m.crash_restart()``."""

    def __init__(self) -> None:
        self.port = free_port()
        # mariadbd refuses to run as root unless told to; it runs as mysql then.
        self.dir = private_dir("tg-mariadb-", _OS_USER)
        self.data = self.dir / "data"
        self.logfile = self.dir / "server.log"
        self.pidfile = self.dir / "mariadbd.pid"
        self.proc: subprocess.Popen[bytes] | None = None
        self._user = [f"--user={_OS_USER}"] if os.geteuid() == 0 else []
        proc = subprocess.run(
            [
                INSTALL_DB,
                "--no-defaults",
                f"--datadir={self.data}",
                *self._user,
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        if proc.returncode != 0:
            self.destroy()
            raise RuntimeError(f"mariadb-install-db failed: {proc.stderr.strip()[-2000:]}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the server (InnoDB crash recovery runs if it was crashed) and wait."""
        self.proc = subprocess.Popen(
            [
                MARIADBD,
                "--no-defaults",
                f"--datadir={self.data}",
                *self._user,
                f"--port={self.port}",
                "--bind-address=127.0.0.1",
                f"--socket={self.dir / 'mariadbd.sock'}",
                f"--pid-file={self.pidfile}",
                f"--log-error={self.logfile}",
                "--skip-name-resolve",
                "--skip-log-bin",
                "--innodb-buffer-pool-size=64M",
                "--innodb-flush-log-at-trx-commit=1",
                "--max-connections=200",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mariadbd exited ({self.proc.returncode}):\n{self.tail_log()}")
            try:
                _connect(self.port).close()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def crash(self) -> None:
        """SIGKILL the server: no shutdown, no flush; the next start runs recovery."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=60)

    def stop(self) -> None:
        """SIGKILL: nothing to keep (a crash's recovery is tested by :meth:`crash`)."""
        if self.running and self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=60)

    # -- addressing ------------------------------------------------------------------

    def url(self, database: str = "mysql", port: int | None = None) -> str:
        """SQLAlchemy URL; ``port`` lets a client go through a proxy instead."""
        return f"mysql+mysqldb://root@127.0.0.1:{port or self.port}/{database}?charset=utf8mb4"

    def create_database(self, name: str) -> str:
        conn = _connect(self.port)
        try:
            cur = conn.cursor()
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
            cur.execute(f"CREATE DATABASE `{name}`")
        finally:
            conn.close()
        return self.url(name)
