"""Whether this process runs on green threads: gevent or eventlet monkey-patched it
(Celery's ``-P gevent`` and ``-P eventlet`` do so before the app is imported). Its
threads are then greenlets sharing one OS thread: a call that blocks in C (not
through the patched ``select``/``socket``) stops them all. Imports neither library."""

from __future__ import annotations

import sys

__all__ = ["green_library"]


def green_library() -> str | None:
    """``"gevent"`` or ``"eventlet"`` if that library has patched ``threading``."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        return "eventlet"
    return None
