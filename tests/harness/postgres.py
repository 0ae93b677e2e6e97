"""Private PostgreSQL servers: a cluster we may crash or freeze, and a primary with a
streaming standby to fail over to.

``initdb`` into a fresh temp dir, started on a free loopback port with its socket in
that dir; every server binary runs as the ``postgres`` OS user when we are root.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psycopg

from taskguard import schema
from tests.harness.servers import CrashableServer, as_user, free_port, private_dir

__all__ = ["PG_BIN", "ReplicatedPair", "Standby", "ThrowawayCluster"]

PG_BIN = Path(os.environ.get("TASKGUARD_PG_BIN", "/usr/lib/postgresql/15/bin"))
_OS_USER = "postgres"


class ThrowawayCluster(CrashableServer):
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
        self.dir = private_dir("tg-pg-", _OS_USER)
        self.data = self.dir / "data"
        self.logfile = self.dir / "server.log"
        self.running = False
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise

    def _create(self) -> None:
        options = "-U postgres --auth=trust --no-sync -E UTF8 --locale=C"
        self._pg("initdb", "-D", str(self.data), *options.split())

    # -- lifecycle ---------------------------------------------------------------

    def _pg(self, binary: str, *args: str) -> None:
        """Run a server binary (as the server's OS user); its stderr in the error."""
        cmd = [str(PG_BIN / binary), *args]
        proc = subprocess.run(
            as_user(_OS_USER, cmd), capture_output=True, text=True, timeout=120, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{binary} {args[0]} failed ({proc.returncode}): {proc.stderr.strip()}\n"
                f"{self.tail_log()}"
            )

    def _ctl(self, *args: str) -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-w", "-t", "120", *args)

    def start(self) -> None:
        """Start the server (runs crash recovery if it was crashed) and wait for it."""
        opts = [f"-p {self.port}", f"-k {self.dir}"]
        opts += [f"-c {k}={v}" for k, v in self.settings.items()]
        self._ctl("-l", str(self.logfile), "-o", " ".join(opts), "start")
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
        self._ctl("-m", "immediate", "stop")
        self.running = False

    def postmaster(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def _children(self) -> list[int]:
        pid = self.postmaster()
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    def freeze(self) -> None:
        """SIGSTOP every server process: connections stay open and new ones are
        accepted by the kernel, but nothing answers (a hung host)."""
        self.frozen = True
        os.kill(self.postmaster(), signal.SIGSTOP)  # first: it forks no one meanwhile
        for child in self._children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT what :meth:`freeze` stopped (it then answers what waited)."""
        for child in self._children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGCONT)
        os.kill(self.postmaster(), signal.SIGCONT)
        self.frozen = False

    def kill(self) -> None:
        """SIGKILL every process (postmaster first, so nothing restarts): a lost host."""
        children = self._children()
        for pid in [self.postmaster(), *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.running = False

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode``, thawing it first if it is frozen."""
        if self.frozen:
            self.thaw()
        if self.running:
            self.running = False
            self._ctl("-m", mode, "stop")

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        super().destroy()

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


class Standby(ThrowawayCluster):
    """A streaming standby of ``primary``, made with ``pg_basebackup -R``."""

    def __init__(self, primary: ThrowawayCluster) -> None:
        self.primary = primary
        # Once promoted it is alone: a synchronous setting would make every commit wait
        # forever for a standby that does not exist.
        super().__init__({**primary.settings, "synchronous_standby_names": "''"})

    def _create(self) -> None:
        primary = ["-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres"]
        options = ["-R", "-X", "stream", "--checkpoint=fast", "--no-sync"]
        self._pg("pg_basebackup", *primary, "-D", str(self.data), *options)

    def promote(self) -> float:
        """``pg_ctl promote -w``; returns the seconds it took."""
        t0 = time.monotonic()
        self._ctl("promote")
        return time.monotonic() - t0

    def walreceiver_pid(self) -> int | None:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            row = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walreceiver'"
            ).fetchone()
        return int(row[0]) if row else None

    def wait_caught_up(self, timeout: float = 30.0) -> None:
        """Until everything received has been replayed (read-only queries see it).
        Call it once a killed WAL receiver has been reaped: its postmaster
        reinitialises then, and this waits for that too."""
        self.wait_ready(timeout)
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT pg_last_wal_receive_lsn() <= pg_last_wal_replay_lsn()"
                ).fetchone()
                if row and row[0]:
                    return
                time.sleep(0.02)
        raise TimeoutError("standby did not replay what it received")


class ReplicatedPair:
    """``with ReplicatedPair(sync=True) as rp: rp.url(db)``: a primary and a standby
    streaming from it, synchronously (``synchronous_standby_names = '*'``) or not."""

    def __init__(self, *, sync: bool = True) -> None:
        self.sync = sync
        self.primary = ThrowawayCluster(
            {
                "wal_level": "replica",
                "max_wal_senders": "4",
                "synchronous_standby_names": "'*'" if sync else "''",
                "synchronous_commit": "on",
                "wal_receiver_status_interval": "1s",
            }
        )
        self.standby: Standby | None = None

    def __enter__(self) -> ReplicatedPair:
        try:
            self.primary.start()
            self.standby = Standby(self.primary)
            self.standby.start()
            self._wait_streaming()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.destroy()

    def destroy(self) -> None:
        if self.standby is not None:
            self.standby.destroy()
        self.primary.destroy()

    def _wait_streaming(self, timeout: float = 30.0) -> None:
        want = "sync" if self.sync else "async"
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
            while time.monotonic() < deadline:
                rows = conn.execute("SELECT state, sync_state FROM pg_stat_replication").fetchall()
                if ("streaming", want) in rows:
                    return
                time.sleep(0.05)
        raise TimeoutError(f"standby never reached streaming/{want}")

    def url(self, database: str) -> str:
        """Multi-host SQLAlchemy URL: whichever of the two accepts writes."""
        assert self.standby is not None
        return (
            f"postgresql+psycopg://postgres@/{database}?host=127.0.0.1:{self.primary.port}"
            f"&host=127.0.0.1:{self.standby.port}&target_session_attrs=read-write"
            "&connect_timeout=2"
        )

    def create_database(self, name: str) -> str:
        """A database on the primary, migrated; its multi-host URL."""
        self.primary.create_database(name)
        url = self.url(name)
        schema.upgrade(url)
        return url
