"""The ``taskguard`` message header: what travels from the publisher to the worker.

``{"v": 1, "key": <stored lock key>, "via": "enqueue"|"retry",
"lease": Lease.to_dict() (a lease handed to the worker), "deferred": True
(published late by on_conflict="retry" at enqueue, or retried after a conflict in
the worker under lock="queue": the worker checks the key again), "marker": <marker>
(a canvas member answered at enqueue, skipped or coalesced; the worker returns the
marker without running)}``.
[coalesce/debounce/rate] also ``"pending": Lease.to_dict()`` (the key's pending
place, see taskguard.celery.pending), ``"debounce": {"batch": Lease.to_dict()}``,
``"polls": n`` (deferrals so far) and ``"deferred": "rate"|"coalesce"`` on a copy
published by taskguard.celery.deferral.

The key is derived once, when the message is published, and every later step
(the run, a retry, the worker's clean-up after a dead child) uses the carried
key; it is derived again only for a message without one (``send_task``, beat, a
message from before the header existed). The header is trusted like the rest of
the message: whoever can publish to the broker can already run any task with any
arguments. A carried key that is not a valid key is ignored (derived instead).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from taskguard.celery.options import GuardOptions
from taskguard.exceptions import InvalidKey
from taskguard.keys import normalize_key

__all__ = ["HEADER", "header_of", "message_key"]

log = logging.getLogger("taskguard.celery")

#: The message header taskguard's state travels in (see the module docstring).
HEADER = "taskguard"


def header_of(request: Any) -> dict[str, Any]:
    """taskguard's header from a Celery request/context (worker: an attribute;
    eager ``apply()``: inside ``request.headers``) or a request dict, or ``{}``."""
    if isinstance(request, Mapping):
        value, headers = request.get(HEADER), request.get("headers")
    else:
        value = getattr(request, HEADER, None)
        if type(value) is dict:  # a worker's request, read on every run: no ABC checks
            return dict(value)
        headers = getattr(request, "headers", None)
    if not isinstance(value, Mapping) and isinstance(headers, Mapping):
        value = headers.get(HEADER)
    return dict(value) if isinstance(value, Mapping) else {}


def message_key(options: GuardOptions, header: Mapping[str, Any], args: Any, kwargs: Any) -> str:
    """The lock key of a message: the one it carries, else derived from its arguments."""
    carried = header.get("key")
    if isinstance(carried, str) and carried:
        try:
            return normalize_key(carried)
        except InvalidKey as exc:
            log.warning("ignoring the lock key carried in a message: %s", exc)
    return options.deriver.derive(args, kwargs)
