"""A private memcached for the storm section: installed when missing, started on a free
loopback port, stopped afterwards. Never touches a system memcached service."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The repo's installer for the Debian packages tests and benchmarks run private copies of.
SERVICES_SH = REPO / "scripts" / "services.sh"


def binary() -> str | None:
    return shutil.which("memcached") or next(
        (p for p in ("/usr/bin/memcached", "/usr/sbin/memcached") if os.access(p, os.X_OK)), None
    )


def ensure_installed() -> str:
    """Path of the memcached binary, installing the Debian package first if it is missing
    (through scripts/services.sh when the checkout has it, else apt-get directly)."""
    found = binary()
    if found:
        return found
    if SERVICES_SH.exists():
        print("-- storm: memcached missing; running scripts/services.sh", file=sys.stderr)
        subprocess.run(["bash", str(SERVICES_SH)], check=True, timeout=600)
    else:
        # scripts/services.sh (the repo's one installer) is not in this checkout yet.
        print(
            "-- storm: memcached missing and no scripts/services.sh; "
            "installing the Debian package with apt-get",
            file=sys.stderr,
        )
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        penv = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True, env=penv, timeout=600)
        subprocess.run(
            [*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", "memcached"],
            check=True,
            env=penv,
            timeout=600,
        )
    found = binary()
    if not found:
        raise RuntimeError(
            "memcached is not installed and installing it failed; "
            "run `apt-get install -y memcached` and retry"
        )
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"version\r\n")
            return s.recv(64).startswith(b"VERSION")
    except OSError:
        return False


@contextlib.contextmanager
def running() -> Iterator[str]:
    """Start a memcached of our own; yields ``"127.0.0.1:PORT"``; stops it afterwards."""
    exe = ensure_installed()
    port = _free_port()
    # TCP only (-U 0), loopback only; memcached refuses to run as root without -u.
    cmd = [exe, "-p", str(port), "-l", "127.0.0.1", "-U", "0", "-m", "64", "-t", "2"]
    if os.geteuid() == 0:
        cmd += ["-u", "nobody"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not _answers(port):
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"memcached exited with code {proc.returncode}: {err.strip()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"memcached did not answer on 127.0.0.1:{port} within 10 s")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stderr:
            proc.stderr.close()
