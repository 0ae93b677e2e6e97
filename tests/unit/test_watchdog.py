"""The statement watchdog (taskguard/deadline.py) on a real socket pair: it shuts a
socket down past its deadline, never after the statement ended, and keeps nothing
for statements that ended (the heap it replaced kept every one until the earliest
deadline passed)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from taskguard import deadline
from taskguard.deadline import _Watchdog, call_limit, current_deadline, pop_limit, push_limit


@pytest.fixture()
def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_statement_past_its_limit_has_its_socket_shut_down(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    dog = _Watchdog()
    a, _ = pair
    w = dog.start(a.fileno(), 0.05)
    assert w is not None
    a.settimeout(5)
    assert a.recv(1) == b""  # the peer sees end-of-stream once shut down
    dog.stop(w)
    assert w.fired


def test_an_ended_statement_is_never_shut_down_and_leaves_nothing_behind(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    dog = _Watchdog()
    a, b = pair
    for _ in range(10_000):
        dog.stop(dog.start(a.fileno(), 0.2))
    assert dog._active == {}
    time.sleep(0.4)
    b.sendall(b"x")
    a.settimeout(1)
    assert a.recv(1) == b"x"  # still open: every watch ended before its deadline


def test_an_earlier_deadline_wakes_the_thread(pair: tuple[socket.socket, socket.socket]) -> None:
    dog = _Watchdog()
    a, _ = pair
    far = dog.start(a.fileno(), 60.0)  # the thread now sleeps towards +60 s
    started = time.monotonic()
    near = dog.start(a.fileno(), 0.05)
    a.settimeout(5)
    assert a.recv(1) == b""
    assert time.monotonic() - started < 2.0
    assert near is not None and near.fired and far is not None and not far.fired
    dog.stop(near)
    dog.stop(far)


def test_the_thread_exits_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deadline, "_IDLE_EXIT", 0.05)
    dog = _Watchdog()
    a, b = socket.socketpair()
    try:
        dog.stop(dog.start(a.fileno(), 10.0))
        thread = dog._thread
        assert thread is not None
        thread.join(2.0)
        assert not thread.is_alive() and dog._thread is None
        w = dog.start(a.fileno(), 10.0)  # and a new one starts on demand
        assert dog._thread is not None and dog._thread.is_alive()
        dog.stop(w)
    finally:
        a.close()
        b.close()


def test_no_socket_nothing_to_watch() -> None:
    assert _Watchdog().start(None) is None


def test_limits_only_ever_narrow() -> None:
    assert current_deadline() is None
    with call_limit(5.0) as outer:
        token = push_limit(60.0)
        assert current_deadline() == outer  # a wider inner limit does not widen it
        pop_limit(token)
        token = push_limit(0.5)
        inner = current_deadline()
        assert inner is not None and inner < outer
        pop_limit(token)
        assert current_deadline() == outer
    assert current_deadline() is None


def test_limits_are_per_thread() -> None:
    seen: list[float | None] = []
    with call_limit(5.0):
        t = threading.Thread(target=lambda: seen.append(current_deadline()))
        t.start()
        t.join()
    assert seen == [None]


def test_within_stops_waiting_and_discards_what_comes_late() -> None:
    from taskguard.deadline import within

    release = threading.Event()
    discarded: list[str] = []

    def slow() -> str:
        release.wait(5)
        return "late"

    t0 = time.monotonic()
    assert within(slow, 0.2, discarded.append) is None
    assert time.monotonic() - t0 < 1.0
    release.set()
    deadline = time.monotonic() + 5
    while not discarded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert discarded == ["late"]
    assert within(lambda: "fast", 5.0, discarded.append) == "fast"

    def fails() -> str:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        within(fails, 5.0, discarded.append)
