"""What a message carries: the ``taskguard`` header, task ids as stored, taskguard's
result markers, and a submission answered at enqueue.

:class:`Header` is the header's one definition; every message taskguard publishes
(enqueue, a retry, a deferred copy, a canvas member answered at enqueue) writes it
with :meth:`Header.to_message`, and a run reads it once with :meth:`Header.of`.

The key is derived once, when the message is published, and every later step
(the run, a retry, the worker's clean-up after a dead child) uses the carried
key; it is derived again only for a message without one (``send_task``, beat, a
message from before the header existed). The header is trusted like the rest of
the message: whoever can publish to the broker can already run any task with any
arguments. A carried key that is not a valid key is ignored (derived instead).

Task ids as the lock table stores them (:func:`stored_task_id`): Celery accepts
any string as a task id (300 characters, NUL, lone surrogates); the ``task_id``
column holds at most 255 characters of valid text without NUL. An id that fits is
stored as it is; any other becomes a bounded form, ``<first 64 characters,
escaped>...#<sha256 digest>``, the same in every process. Logs, skipped markers
and errors show the full id; only rows read back from the table carry the bounded
one.

A run skipped because its key was held does not pretend to have succeeded with
``None``: its return value (and so the stored result, what ``AsyncResult.get()``
returns, and what chained callbacks receive) is a plain dict::

    {
        "__taskguard__": "skipped",
        "task": "app.tasks.fetch_feed",
        "task_id": "6f1c…",          # the skipped submission
        "key": "feed:https://…",
        "phase": "run",              # "run": refused by the worker; "queue": at .delay()
        "holder": {...} | None,      # LockInfo.to_dict() of the holder, if it could be read
    }

It is a plain dict so it survives any result serializer. Test with
:func:`is_skipped` (on the value, or on the ``AsyncResult`` of a finished task);
the Celery state of such a result is ``SUCCESS``.

A :class:`Submission` answered at enqueue (skipped, or merged into a pending run)
publishes nothing outside a canvas (:meth:`Submission.answer`); inside one (a
chord or group member, a chain link, a task with link callbacks) the message is
published anyway, carrying its marker, and the worker returns the marker without
running the body: the chord counts it, the chain passes it on, and nothing waits
for a task that was never sent.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, NamedTuple

from celery import states as celery_states
from celery.result import AsyncResult, EagerResult

from taskguard.exceptions import InvalidArgument, InvalidKey
from taskguard.guard import TaskGuard
from taskguard.lease import Lease
from taskguard.results import MARKER, SKIPPED
from taskguard.validation import normalize_key

__all__ = [
    "HEADER",
    "Handed",
    "Header",
    "Submission",
    "carry",
    "has_marker",
    "in_canvas",
    "is_shortened",
    "is_skipped",
    "stored_task_id",
]

log = logging.getLogger("taskguard.celery")


#: The message header taskguard's state travels in.
HEADER = "taskguard"
#: Version of the header's layout; published as ``"v"`` from version 2 on.
VERSION = 1
#: Joins the key and a handed-over lease in a header published as one string (the
#: cheapest to serialize); no key contains it.
JOIN = "\x00"


class Header(NamedTuple):
    """What one message carries for taskguard (every field optional)."""

    #: The stored lock key, derived at publish.
    key: str | None = None
    #: ``"enqueue"`` (published by ``apply_async``) or ``"retry"`` (a retry or a
    #: deferred copy, which carries its own lease or none).
    via: str = "enqueue"
    #: A lease handed to the worker in its compact form (:func:`carry`; a dict,
    #: ``Lease.to_dict()``, from a version before it): taken at enqueue (queue phases),
    #: kept across a retry, or held by a run an outage put off. Read by :meth:`Handed.of`.
    lease: str | dict[str, Any] | None = None
    #: Set on a copy published late: ``True`` (on_conflict="retry" at enqueue, or a
    #: lock="queue" conflict in the worker: the worker checks the key again), or the
    #: reason of a deferral (``"rate"``, ``"coalesce"``, ``"outage"``).
    deferred: bool | str | None = None
    #: A canvas member answered at enqueue (skipped, coalesced): the worker returns it.
    marker: dict[str, Any] | None = None
    #: The key's pending place (``Lease.to_dict()``; coalesce, debounce).
    pending: dict[str, Any] | None = None
    #: ``{"batch": Lease.to_dict()}``: the debounce batch the run ends.
    debounce: dict[str, Any] | None = None
    #: Deferrals of a pending run so far.
    polls: int = 0
    #: ``{"since": <epoch seconds>, "n": <deferrals>}`` of a run put off by an outage.
    outage: dict[str, Any] | None = None

    @classmethod
    def of(cls, request: Any) -> Header:
        """The header of a Celery request/context (worker: an attribute; eager
        ``apply()``: inside ``request.headers``) or a request dict; empty if none."""
        value = getattr(request, HEADER, None)  # a worker's request: an attribute
        if type(value) is str:  # read on every run: the key alone (or with a lease)
            return cls(value) if JOIN not in value else cls.of_string(value)
        if isinstance(request, Mapping):
            value, headers = request.get(HEADER), request.get("headers")
        else:
            if type(value) is dict:
                return cls.from_dict(value)
            headers = getattr(request, "headers", None)
        if not isinstance(value, (str, Mapping)) and isinstance(headers, Mapping):
            value = headers.get(HEADER)
        if isinstance(value, str):
            return cls.of_string(value)
        return cls.from_dict(value) if isinstance(value, Mapping) else _EMPTY

    @classmethod
    def of_string(cls, value: str) -> Header:
        """A header published as a string: the key, then the lease it hands over, if
        any (after :data:`JOIN`)."""
        key, _, lease = value.partition(JOIN)
        return cls(key, lease=lease or None)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> Header:
        """The header as published (unknown fields ignored, wrong types dropped)."""
        get = value.get
        if value.keys() <= _PLAIN:  # the common case: the key alone
            return cls(get("key"), get("via") or "enqueue")
        polls = get("polls")
        lease, marker, pending = get("lease"), _dict(get("marker")), _dict(get("pending"))
        lease = lease if isinstance(lease, str) else _dict(lease)
        polls = polls if type(polls) is int else 0
        extra = (pending, _dict(get("debounce")), polls, _dict(get("outage")))
        return cls(get("key"), get("via") or "enqueue", lease, get("deferred"), marker, *extra)

    def to_message(self) -> str | dict[str, Any]:
        """The header as published: the key alone as a string (the common case: a
        plain header is the cheapest to serialize), or the key and the lease a queue
        phase hands over, joined by :data:`JOIN`; else the fields set, defaults left
        out (no ``via`` for ``"enqueue"``, no ``v`` for version 1)."""
        key, lease = self.key, self.lease
        if key is not None and self[1:] == ("enqueue", lease, *_REST) and type(lease) is not dict:
            return key if lease is None else f"{key}{JOIN}{lease}"
        out: dict[str, Any] = {} if key is None else {"key": key}
        if self.via != "enqueue":
            out["via"] = self.via
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value:
                out[name] = value
        return out

    def message_key(self, derive: Callable[[Any, Any], str], args: Any, kwargs: Any) -> str:
        """The lock key of the message: the one it carries, else ``derive(args,
        kwargs)`` (the task's key deriver)."""
        carried = self.key
        if type(carried) is str and carried:
            try:
                return normalize_key(carried)
            except InvalidKey as exc:
                log.warning("ignoring the lock key carried in a message: %s", exc)
        return derive(args, kwargs)


def carry(lease: Lease, alternate: str | None = None) -> str:
    """``lease`` as a message hands it over (``Header.lease``; the key is the
    header's): one string, ``"<owner> <slot> <min_hold> <token> <acquired_at>
    <expires_at>"`` (times in ISO 8601), then ``alternate`` if given: a second owner
    id that may hold the key instead (see :func:`taskguard.celery.deferral.retry_later`).
    Read back by :meth:`Handed.of`."""
    at, until = lease.acquired_at.isoformat(), lease.expires_at.isoformat()
    tail = f" {alternate}" if alternate else ""
    return f"{lease.owner} {lease.slot} {lease.min_hold!r} {lease.token} {at} {until}{tail}"


class Handed(NamedTuple):
    """A lease a message hands over, as carried: what adopting it needs (owner id,
    slot, throttle window) and what giving it back unadopted reports (:meth:`lease`)."""

    owner: str
    slot: int
    min_hold: float
    token: int
    acquired_at: str
    expires_at: str
    #: A second owner id that may hold the key instead.
    alternate: str | None = None

    @classmethod
    def of(cls, value: str | Mapping[str, Any]) -> Handed:
        """``Header.lease`` read (see :func:`carry`). Raises ``ValueError``,
        ``KeyError`` or ``TypeError`` if it is malformed."""
        if isinstance(value, str):
            owner, slot, hold, token, at, until, *alternate = value.split(" ")
            other = alternate[0] if alternate else None
            return cls(owner, int(slot), float(hold), int(token), at, until, other)
        # A dict (Lease.to_dict()): published by a version before the compact form and
        # still queued during a rolling upgrade.
        get = value.get
        was = [str(value[name]) for name in _DICT_FIELDS]  # owner, token, times
        numbers = int(get("slot", 0)), float(get("min_hold", 0)), int(was[1])
        return cls(was[0], *numbers, was[2], was[3], str(get("alternate") or "") or None)

    def lease(self, key: str | None) -> Lease:
        """The lease, to give it back by its owner id (or report it) unadopted."""
        acquired = datetime.fromisoformat(self.acquired_at)
        expires = datetime.fromisoformat(self.expires_at)
        ttl = max((expires - acquired).total_seconds(), 0.001)
        return Lease(
            str(key), self.owner, self.token, acquired, expires, ttl, self.slot, self.min_hold
        )


_DICT_FIELDS = ("owner", "token", "acquired_at", "expires_at")
_OPTIONAL = ("lease", "deferred", "marker", "pending", "debounce", "polls", "outage")
_PLAIN = {"v", "key", "via"}
_EMPTY = Header()
_REST = _EMPTY[3:]


def _dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


# -- task ids ----------------------------------------------------------------------------


#: Width of the ``task_id`` column.
MAX_STORED_ID = 255
_PREFIX_CHARS = 64
_DIGEST_CHARS = 32
_SHORTENED = re.compile(rf"\.\.\.#[0-9a-f]{{{_DIGEST_CHARS}}}\Z")


def _fits(task_id: str) -> bool:
    if task_id.isascii():  # a uuid, the common case
        return len(task_id) <= MAX_STORED_ID and "\x00" not in task_id
    if len(task_id) > MAX_STORED_ID or "\x00" in task_id:
        return False
    try:
        task_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def stored_task_id(task_id: str | None) -> str | None:
    """``task_id`` as stored in the lock table (see the module docstring)."""
    if task_id is None or _fits(task_id):
        return task_id
    raw = task_id.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(raw).hexdigest()[:_DIGEST_CHARS]
    prefix = task_id[:_PREFIX_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
    prefix = prefix.replace("\x00", "\\x00")[:_PREFIX_CHARS]
    return f"{prefix}...#{digest}"


def is_shortened(stored: str | None) -> bool:
    """Whether a stored id is the bounded form of a longer one (not usable as an id)."""
    return stored is not None and bool(_SHORTENED.search(stored))


# -- markers -------------------------------------------------------------------------------


#: ``apply_async`` options that make a message part of a canvas: something waits
#: for its result or is published after it.
CANVAS_OPTIONS = ("chord", "group_id", "chain", "link", "link_error")


def is_skipped(value: object) -> bool:
    """Whether ``value`` is the result of a run skipped because its lock was held:
    a task's return value, ``AsyncResult.get()``, or the ``AsyncResult`` itself
    (what ``.delay()`` returns) once the task has finished. An ``AsyncResult`` of a
    task still queued or running cannot tell yet: :class:`~taskguard.InvalidArgument`
    says so (``is_skipped(result.get())`` waits for it)."""
    return has_marker(value, SKIPPED, "is_skipped")


def has_marker(value: object, kind: str, check: str) -> bool:
    """Whether ``value`` (a value, or a finished task's ``AsyncResult``) is the
    ``kind`` marker; ``check`` names the public function in the error."""
    if isinstance(value, AsyncResult):
        try:
            state = str(value.state)
        except NotImplementedError:  # no result backend: nothing to read
            state = "unknown: the app has no result backend"
        if state not in celery_states.READY_STATES:
            raise InvalidArgument(
                f"{check}(): task {value.id} has not finished (state {state}), so "
                f"whether it was {kind} is not known yet; pass result.get() to wait for it",
                "value",
                value,
            )
        value = value.result
    return isinstance(value, dict) and value.get(MARKER) == kind


def in_canvas(options: Mapping[str, Any]) -> bool:
    """Whether a message published with ``options`` is part of a canvas."""
    return any(options.get(name) for name in CANVAS_OPTIONS)


# -- a submission --------------------------------------------------------------------------


#: ``send(args, kwargs, task_id, headers, options)``: Celery's own apply_async.
Send = Callable[[Any, Any, Any, dict[str, Any], dict[str, Any]], Any]


class Submission(NamedTuple):
    """One ``apply_async`` of a guarded task that takes a lease before it publishes
    (a queue phase's, a pending place): what Celery's publish takes, and the key."""

    task: Any
    #: Celery's own publish.
    send: Send
    key: str
    task_id: str
    args: Any
    kwargs: Any
    headers: dict[str, Any]
    options: dict[str, Any]
    guard: TaskGuard
    #: The lease's length: the task's ``queue_ttl`` plus the publish's countdown.
    ttl: float
    #: The task's options (``task.taskguard_options``).
    opts: Any

    def publish(self, header: Header) -> Any:
        """Publish the message, carrying ``header``."""
        self.headers[HEADER] = header.to_message()
        return self.send(self.args, self.kwargs, self.task_id, self.headers, self.options)

    def answer(self, value: dict[str, Any]) -> Any:
        """What ``apply_async`` returns for a submission answered at enqueue with the
        marker ``value`` (see the module docstring): outside a canvas an EagerResult
        holding ``value``, also stored in the result backend (where results are kept)
        so ``AsyncResult(task_id)`` finds it."""
        task, task_id, options = self.task, self.task_id, self.options
        if in_canvas(options):
            return self.publish(Header(self.key, marker=value))
        conf = task._get_app().conf
        if not options.get("ignore_result", task.ignore_result) and (
            not conf.task_always_eager or conf.task_store_eager_result
        ):
            try:
                task.backend.store_result(task_id, value, celery_states.SUCCESS)
            except Exception as exc:  # the caller still gets the marker in hand
                log.warning("could not store the %s result of %s: %s", value[MARKER], task_id, exc)
        return EagerResult(task_id, value, celery_states.SUCCESS, name=task.name)
