"""A loopback TCP proxy in front of PostgreSQL that cuts a connection on demand.

``arm("before", match)`` - the next client message containing ``match`` is not
forwarded: the connection is closed, so the server never sees the statement.
Armings queue up and fire in order.
``arm("after", match)`` - the message is forwarded, the server's reply is held
back until its ReadyForQuery (the statement has committed in autocommit mode)
and then the connection is closed without the client seeing the reply.

``refuse = True`` drops every new connection (the server looks gone), so a
client cannot read back the outcome of a cut statement.

``freeze()`` is a silent partition: nothing is forwarded either way and new
connections wait unanswered in the listen backlog (the client's connect succeeds,
its start-up gets no reply), as when packets to a host are dropped; ``thaw()``
delivers what waited, late, like TCP retransmissions after the partition heals.

Only connections past start-up are eligible, so a cut always hits a statement,
never a login. Each arming fires once; ``fired`` counts cuts per mode.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections import Counter

# PostgreSQL ReadyForQuery: 'Z', int32 length 5, status byte.
_READY = b"Z\x00\x00\x00\x05"
#: How often (seconds) the threads look at the flags.
_TICK = 0.05


class _Pair:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.ready = False  # start-up finished (server sent ReadyForQuery once)
        self.swallow = False  # "after" cut in progress: hold replies until ReadyForQuery
        self.partition = False  # ... and then cut everything and refuse reconnections
        self.tail = b""

    def close(self) -> None:
        for s in (self.client, self.server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


class FaultProxy:
    """Forward 127.0.0.1:``port`` to 127.0.0.1:``target_port`` with armed cuts."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._armed: list[tuple[str, bytes]] = []
        self._pairs: set[_Pair] = set()
        self._closed = False
        #: While True, new connections are accepted and dropped at once (server "gone").
        self.refuse = False
        #: While True, nothing moves (see :meth:`freeze`).
        self.frozen = False
        self.fired: Counter[str] = Counter()
        self._accept_thread = threading.Thread(target=self._accept, daemon=True)
        self._accept_thread.start()

    def arm(self, mode: str, match: bytes = b"") -> None:
        """Cut the next eligible statement containing ``match``: ``before`` or ``after``
        it reaches the server; ``partition`` is ``after`` and then :attr:`refuse` plus
        every other connection dropped, so the outcome cannot be read back."""
        if mode not in ("before", "after", "partition"):
            raise ValueError(f"mode must be 'before', 'after' or 'partition', not {mode!r}")
        with self._lock:
            self._armed.append((mode, match))

    @property
    def armed(self) -> int:
        """How many armed cuts have not fired yet."""
        with self._lock:
            return len(self._armed)

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()

    def freeze(self) -> None:
        """Stop forwarding and accepting (a partition that drops packets silently)."""
        self.frozen = True

    def thaw(self) -> None:
        """Forward and accept again; what waited is delivered now."""
        self.frozen = False

    def cut_all(self) -> int:
        """Drop every open connection at once (a network partition)."""
        with self._lock:
            pairs = list(self._pairs)
        for p in pairs:
            p.close()
        self.fired["all"] += len(pairs)
        return len(pairs)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut_all()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------

    def _accept(self) -> None:
        self._listener.settimeout(_TICK)
        while not self._closed:
            if self.frozen:  # connections wait in the kernel's backlog, unanswered
                time.sleep(_TICK)
                continue
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            if self.refuse:
                client.close()
                self.fired["refused"] += 1
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            pair = _Pair(client, server)
            with self._lock:
                self._pairs.add(pair)
            threading.Thread(target=self._pump, args=(pair,), daemon=True).start()

    def _take_arming(self, pair: _Pair, data: bytes) -> str | None:
        with self._lock:
            if not self._armed or not pair.ready:
                return None
            mode, match = self._armed[0]
            if match and match not in data:
                return None
            self._armed.pop(0)
            self.fired[mode] += 1
            return mode

    def _pump(self, pair: _Pair) -> None:
        try:
            while not self._closed:
                if self.frozen:
                    time.sleep(_TICK)
                    continue
                readable, _, _ = select.select([pair.client, pair.server], [], [], _TICK)
                if self._closed:
                    return
                if self.frozen:
                    continue
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is pair.client:
                        mode = self._take_arming(pair, data)
                        if mode == "before":
                            return
                        if mode in ("after", "partition"):
                            pair.swallow = True
                            pair.partition = mode == "partition"
                        pair.server.sendall(data)
                    else:
                        seen = pair.tail + data
                        pair.tail = seen[-5:]
                        if _READY in seen:
                            pair.ready = True
                        if pair.swallow:
                            if _READY in seen:
                                if pair.partition:
                                    self.refuse = True
                                    self.cut_all()
                                return  # committed; the client never hears about it
                            continue
                        pair.client.sendall(data)
        except (OSError, ValueError):  # ValueError: closed by cut_all() while frozen
            return
        finally:
            pair.close()
            with self._lock:
                self._pairs.discard(pair)
