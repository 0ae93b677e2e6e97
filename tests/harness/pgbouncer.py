"""A private PgBouncer process in front of a PostgreSQL server.

Runs the Debian package's binary (``scripts/services.sh`` installs it), or the
``binary`` given, with its own config, auth file, pid file, log and unix socket
directory in a temp dir, on a free loopback port, as the ``postgres`` OS user when
we are root (it refuses root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time

import psycopg

from tests.harness.servers import PrivateServer, as_user, free_port, give, private_dir

__all__ = ["PgBouncer"]

_OS_USER = "postgres"


def _binary() -> str:
    """Path of the pgbouncer binary; a clear error naming the fix when it is missing."""
    found = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None
    )
    if found is None:
        raise RuntimeError("pgbouncer is not installed: run `bash scripts/services.sh`")
    return found


class PgBouncer(PrivateServer):
    """``with PgBouncer(5432, pool_mode="transaction") as b: b.url("db")``.

    ``server_port``/``server_host``: the PostgreSQL server behind it (trust auth,
    user ``postgres``). ``settings`` are extra ``[pgbouncer]`` lines. ``binary``: a
    pgbouncer binary other than the default one (e.g. a newer release built by hand).
    """

    def __init__(
        self,
        server_port: int = 5432,
        *,
        server_host: str = "127.0.0.1",
        pool_mode: str = "transaction",
        default_pool_size: int = 5,
        settings: dict[str, str] | None = None,
        binary: str | None = None,
    ) -> None:
        self.binary = binary
        self.server_host = server_host
        self.server_port = server_port
        self.pool_mode = pool_mode
        self.port = free_port()
        self.dir = private_dir("tg-pgbouncer-", _OS_USER)
        self.config = self.dir / "pgbouncer.ini"
        self.logfile = self.dir / "pgbouncer.log"
        self.pidfile = self.dir / "pgbouncer.pid"
        self.proc: subprocess.Popen[bytes] | None = None
        options = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": str(self.dir),
            "auth_type": "trust",
            "auth_file": str(self.dir / "userlist.txt"),
            "admin_users": "postgres",
            "pool_mode": pool_mode,
            "default_pool_size": str(default_pool_size),
            "min_pool_size": "0",
            "reserve_pool_size": "0",
            "max_client_conn": "500",
            "max_db_connections": "0",
            "server_lifetime": "3600",
            "server_idle_timeout": "60",
            "logfile": str(self.logfile),
            "pidfile": str(self.pidfile),
            "log_connections": "0",
            "log_disconnections": "0",
            # SQLAlchemy/psycopg send none of these today; a driver that does must not be
            # refused at startup (PgBouncer 1.18 rejects unknown startup parameters).
            "ignore_startup_parameters": "extra_float_digits",
            **(settings or {}),
        }
        lines = [
            "[databases]",
            f"* = host={server_host} port={server_port}",
            "[pgbouncer]",
            *(f"{k} = {v}" for k, v in options.items()),
        ]
        self.config.write_text("\n".join(lines) + "\n")
        (self.dir / "userlist.txt").write_text('"postgres" ""\n')
        give(_OS_USER, self.config, self.dir / "userlist.txt")

    def start(self, timeout: float = 20.0) -> None:
        # Foreground process (no -d): we own its pid and can always stop it.
        self.proc = subprocess.Popen(
            as_user(_OS_USER, [self.binary or _binary(), str(self.config)]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited ({self.proc.returncode}):\n{self.tail_log()}")
            try:
                with psycopg.connect(self.admin_dsn(), autocommit=True, connect_timeout=2) as c:
                    c.execute("SHOW VERSION")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not come up:\n{self.tail_log()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # SIGINT: "safe shutdown"; runuser forwards it to pgbouncer.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    # -- addressing --------------------------------------------------------------------

    def admin_dsn(self) -> str:
        """The admin console (``SHOW POOLS``, ``SHOW STATS``...)."""
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=pgbouncer"

    def url(self, database: str) -> str:
        """SQLAlchemy URL of ``database`` through this pgbouncer."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def via(self, url: str) -> str:
        """``url`` (a database on the server behind us) rewritten to go through us."""
        from sqlalchemy.engine import make_url

        u = make_url(url).set(host="127.0.0.1", port=self.port)
        return u.render_as_string(hide_password=False)

    def show(self, what: str) -> list[dict[str, object]]:
        """Rows of an admin console ``SHOW <what>`` as dicts."""
        with psycopg.connect(self.admin_dsn(), autocommit=True) as conn:
            cur = conn.execute(f"SHOW {what}")
            names = [d.name for d in cur.description or []]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
