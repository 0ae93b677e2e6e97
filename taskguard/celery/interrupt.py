"""``stop_on_lease_loss=True``: raise :class:`~taskguard.LeaseLost` inside the body
once the lease is lost, at the next point Python allows.

What each pool can do:

* **prefork** and **solo**: the body runs in the process's main thread. The
  renewer thread sends the process's main thread ``SIGUSR2`` (the way billiard
  delivers a soft time limit with ``SIGUSR1``); the handler raises the
  ``LeaseLost`` there. A blocking ``time.sleep`` or socket wait is interrupted
  (Python retries the call after running the handler, which raises). A long
  C call that holds the GIL, or a ``try/except BaseException`` that swallows the
  error, is not interrupted.
* **threads**: the body runs in a pool thread, which no signal reaches. The
  renewer uses ``PyThreadState_SetAsyncExc``: the error is raised when that thread
  next executes Python bytecode, so a blocking call (sleep, socket read) delays
  it until the call returns.
* **gevent / eventlet**: every body shares the main thread; neither a signal nor
  an asynchronous exception can target one greenlet, so nothing is raised. Call
  :func:`taskguard.celery.check_lease` before side effects instead.

The error is raised at most once per run and never after the body returned
(the run disarms it first thing).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import threading
from types import FrameType
from typing import Any

from taskguard.exceptions import LeaseLost

__all__ = ["INTERRUPT_SIGNAL", "Interrupter", "pool_kind"]

log = logging.getLogger("taskguard.celery")

#: Signal used to interrupt a body running in a process's main thread.
INTERRUPT_SIGNAL = signal.SIGUSR2

# The run armed in this process's main thread (one at a time: prefork and solo run
# one task per process).
_main_armed: dict[str, Interrupter] = {}
_installed: dict[str, Any] = {}
_warned: set[str] = set()


def pool_kind() -> str:
    """``"main"`` (prefork/solo), ``"thread"`` (threads pool) or ``"green"``."""
    if _green():
        return "green"
    return "main" if threading.current_thread() is threading.main_thread() else "thread"


def _green() -> bool:
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return True
    patcher = sys.modules.get("eventlet.patcher")
    return bool(patcher is not None and patcher.is_monkey_patched("thread"))


def _handler(signum: int, frame: FrameType | None) -> None:
    armed = _main_armed.get("run")
    if armed is not None and armed._take() is not None:
        raise armed.error  # type: ignore[misc]
    previous = _installed.get("previous")
    if callable(previous):
        previous(signum, frame)


def _install() -> bool:
    if "previous" in _installed:
        return True
    try:
        _installed["previous"] = signal.signal(INTERRUPT_SIGNAL, _handler)
    except (ValueError, OSError) as exc:  # not the main thread, or no such signal
        log.warning("stop_on_lease_loss: cannot install the signal handler: %s", exc)
        return False
    return True


class Interrupter:
    """Delivers one :class:`LeaseLost` to the thread running one body."""

    def __init__(self, task_name: str) -> None:
        self.kind = pool_kind()
        self.ident = threading.get_ident()
        self.error: LeaseLost | None = None
        self._lock = threading.Lock()
        self._armed = False
        self._fired = False
        if self.kind == "green" and task_name not in _warned:
            _warned.add(task_name)
            log.warning(
                "%s: stop_on_lease_loss cannot interrupt a body in a gevent/eventlet pool; "
                "call check_lease() before side effects",
                task_name,
            )

    def arm(self) -> Interrupter:
        if self.kind == "main" and not _install():
            self.kind = "none"
        with self._lock:
            self._armed = True
        if self.kind == "main":
            _main_armed["run"] = self
        return self

    def fire(self, error: LeaseLost) -> None:
        """From the renewer thread: raise ``error`` in the body's thread."""
        with self._lock:
            if not self._armed or self._fired:
                return
            self._fired = True
            self.error = error
        if self.kind == "main":
            signal.pthread_kill(self.ident, INTERRUPT_SIGNAL)
        elif self.kind == "thread":
            lost = error

            class _Lost(LeaseLost):
                # SetAsyncExc raises a class: this one rebuilds the real error.
                def __init__(self) -> None:
                    super().__init__(lost.key, lost.owner, lost.reason)

            _Lost.__name__ = _Lost.__qualname__ = "LeaseLost"
            _Lost.__module__ = LeaseLost.__module__
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.ident), ctypes.py_object(_Lost)
            )

    def _take(self) -> LeaseLost | None:
        with self._lock:
            return self.error if self._armed and self._fired else None

    def disarm(self) -> None:
        """In the body's thread, right after the body: no error is raised from now on."""
        with self._lock:
            self._armed = False
            fired = self._fired
        if self.kind == "main" and _main_armed.get("run") is self:
            del _main_armed["run"]
        if fired and self.kind == "thread":
            # Cancel an asynchronous error not yet raised.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), None)
