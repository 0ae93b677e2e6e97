"""What every private server has in common, and the two that keep nothing worth
crashing: Redis and memcached.

A server is a context manager: started on entry, destroyed (stopped, its directory
deleted) on exit, also when its start fails half-way. The database servers refuse to
run as root, so when we are root they run as their usual OS user, who is given the
server's directory.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = [
    "CrashableServer",
    "PrivateMemcached",
    "PrivateRedis",
    "PrivateServer",
    "as_user",
    "free_port",
]

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def as_user(user: str, cmd: list[str]) -> list[str]:
    """``cmd`` run as OS user ``user`` when we are root, else as it is."""
    return ["runuser", "-u", user, "--", *cmd] if os.geteuid() == 0 else cmd


def private_dir(prefix: str, user: str | None = None) -> Path:
    """A new temp dir, given to OS user ``user`` when we are root."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if user is not None:
        give(user, path)
    return path


def give(user: str, *paths: Path) -> None:
    """Make ``user`` the owner of ``paths`` when we are root."""
    if os.geteuid() == 0:
        pw = pwd.getpwnam(user)
        for path in paths:
            os.chown(path, pw.pw_uid, pw.pw_gid)


class PrivateServer:
    """Base of every private server: ``dir`` is deleted by :meth:`destroy`."""

    dir: Path
    logfile: Path

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def destroy(self) -> None:
        """Stop the server (as it can) and delete its directory."""
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def tail_log(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.destroy()


class CrashableServer(PrivateServer):
    """A database server we may crash: :meth:`crash` ends it with no shutdown, and the
    next start runs its recovery."""

    def crash(self) -> None:
        raise NotImplementedError

    def crash_restart(self) -> float:
        """Crash, then start again; returns the seconds the server was down."""
        t0 = time.monotonic()
        self.crash()
        self.start()
        return time.monotonic() - t0


class _Process(PrivateServer):
    """A server that is one foreground process of ours, ready once ``_ready()``."""

    proc: subprocess.Popen[bytes] | None = None
    name = "server"

    def _spawn(self, cmd: list[str], timeout: float = 20.0) -> None:
        with open(self.logfile, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start:\n{self.tail_log()}")
            time.sleep(0.05)

    def _ready(self) -> bool:
        raise NotImplementedError

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class PrivateRedis(_Process):
    """``redis-server`` on a free loopback port, nothing kept on disk; pinned to CPU
    ``core`` with ``taskset`` when given."""

    name = "redis-server"

    def __init__(self, core: int | None = None) -> None:
        self.port = free_port()
        self.core = core
        self.dir = private_dir("tg-redis-")
        self.logfile = self.dir / "redis.log"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian package redis-server)")
        pin = [] if self.core is None else ["taskset", "-c", str(self.core)]
        options = f"--port {self.port} --bind 127.0.0.1 --appendonly no --dir {self.dir}"
        self._spawn([*pin, binary, *options.split(), "--save", ""])

    def _ready(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
            return True
        return False

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"


class PrivateMemcached(_Process):
    """memcached on a free loopback port (TCP only); its Debian package is installed
    by ``scripts/services.sh`` first when it is missing."""

    name = "memcached"

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = private_dir("tg-memcached-")
        self.logfile = self.dir / "memcached.log"

    @staticmethod
    def binary() -> str | None:
        return shutil.which("memcached") or next(
            (p for p in ("/usr/bin/memcached", "/usr/sbin/memcached") if os.access(p, os.X_OK)),
            None,
        )

    def start(self) -> None:
        exe = self.binary()
        if exe is None:
            subprocess.run(["bash", str(REPO / "scripts" / "services.sh")], check=True, timeout=600)
            exe = self.binary()
        if exe is None:
            raise RuntimeError("memcached is not installed: run `apt-get install -y memcached`")
        cmd = [exe, "-p", str(self.port), "-l", "127.0.0.1", "-U", "0", "-m", "64", "-t", "2"]
        # memcached refuses to run as root without -u.
        self._spawn(cmd + (["-u", "nobody"] if os.geteuid() == 0 else []), timeout=10)

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(b"version\r\n")
                return s.recv(64).startswith(b"VERSION")
        except OSError:
            return False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"
