"""What a lock call's values become when stored, validated: keys (stored as
given when they fit; over-long keys shortened deterministically to a readable
prefix and a digest, so that every process stores the same key for the same
input), ttls, concurrency limits, holder details, markers and owner ids.
Keys derived from a call's arguments: :mod:`taskguard.key_derivation`.
"""

from __future__ import annotations

import hashlib
import math
import os
import unicodedata
from datetime import timedelta
from typing import Any

from taskguard.exceptions import ConfigurationError, InvalidArgument, InvalidKey, InvalidTTL
from taskguard.lease import Holder, Marker

__all__ = [
    "MAX_LIMIT",
    "MAX_TTL",
    "MIN_TTL",
    "adopter_for",
    "check_key_text",
    "holder_for",
    "new_owner",
    "normalize_key",
    "normalize_prefix",
    "optional_seconds",
    "validate_limit",
    "validate_marker",
    "validate_ttl",
]

#: Longest key stored verbatim (characters). Matches the column width.
MAX_KEY_LENGTH = 255
#: Hex characters of sha256 that end an over-long stored key (160 bits: collisions
#: are not a practical concern). Part of the stored key: never change it.
_DIGEST_CHARS = 40
_PREFIX_CHARS = MAX_KEY_LENGTH - _DIGEST_CHARS - 1

#: Shortest lease: SQLite's clock has millisecond resolution.
MIN_TTL = 0.001
#: Longest lease: one year. Longer "locks" are configuration, not leases.
MAX_TTL = 366 * 24 * 3600.0
#: Largest concurrency limit: each acquire looks at up to this many slot rows.
MAX_LIMIT = 1000


def new_owner() -> str:
    """A fresh owner id: 32 random hex digits."""
    return os.urandom(16).hex()


def check_key_text(text: str) -> bytes:
    """``text`` as UTF-8, or :class:`InvalidKey` if no key may contain it (NUL, a lone
    surrogate). Also checks a key template's literal text when the task is declared."""
    if "\x00" in text:
        raise InvalidKey(f"lock key must not contain NUL characters: {text[:80]!r}", text)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKey(
            f"lock key is not valid Unicode text (lone surrogate at index {exc.start}): "
            f"{text[:80]!r}",
            text,
        ) from None


def normalize_key(key: object) -> str:
    """Return the key as it is stored, or raise :class:`InvalidKey`.

    Any ``str`` with a character other than whitespace, without NUL and encodable as
    UTF-8 is accepted, in Unicode normal form NFC (``"cafe\u0301"`` and ``"caf\u00e9"``
    are one key). Keys longer than :data:`MAX_KEY_LENGTH` characters become
    ``<prefix>#<sha256 digest>``.
    """
    if not isinstance(key, str):
        raise InvalidKey(f"lock key must be a str, not {type(key).__name__}", key)
    # The common case, checked on every lock call: short printable ASCII (NFC already).
    plain = 0 < len(key) <= MAX_KEY_LENGTH and key.isascii() and key.isprintable()
    if plain and not key.isspace():
        return key
    if not key.strip():
        what = "empty" if not key else f"blank (only whitespace: {key[:20]!r})"
        raise InvalidKey(f"lock key must not be {what}; name the locked thing", key)
    check_key_text(key)
    stored = unicodedata.normalize("NFC", key)
    if len(stored) <= MAX_KEY_LENGTH:
        return stored
    digest = hashlib.sha256(stored.encode("utf-8")).hexdigest()[:_DIGEST_CHARS]
    return f"{stored[:_PREFIX_CHARS]}#{digest}"


def normalize_prefix(prefix: str) -> str:
    """A key prefix in the normal form keys are stored in (NFC), so it finds them."""
    return prefix if prefix.isascii() else unicodedata.normalize("NFC", prefix)


def validate_ttl(ttl: object, *, name: str = "ttl") -> float:
    """Return ``ttl`` as float seconds, or raise :class:`InvalidTTL`.

    Accepts int, float or :class:`datetime.timedelta` between :data:`MIN_TTL` and
    :data:`MAX_TTL` seconds.
    """
    if (type(ttl) is float or type(ttl) is int) and MIN_TTL <= ttl <= MAX_TTL:
        return float(ttl)  # the common case (NaN fails the comparison)
    if isinstance(ttl, timedelta):
        seconds = ttl.total_seconds()
    elif isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise InvalidTTL(
            f"{name} must be a number of seconds or a timedelta, not {type(ttl).__name__}", ttl
        )
    else:
        try:
            seconds = float(ttl)
        except OverflowError:
            raise InvalidTTL(f"{name} is far too large: {ttl!r:.40}", ttl) from None
    if not math.isfinite(seconds):
        raise InvalidTTL(f"{name} must be finite, got {ttl!r}", ttl)
    if seconds < MIN_TTL:
        raise InvalidTTL(f"{name} must be at least {MIN_TTL} seconds, got {ttl!r}", ttl)
    if seconds > MAX_TTL:
        raise InvalidTTL(
            f"{name} must be at most {MAX_TTL:.0f} seconds (366 days), got {ttl!r}", ttl
        )
    return seconds


_MAX_DETAIL = 255  # width of task_name / task_id / hostname
_MAX_PID = 2**31 - 1
_MAX_SLOT = 2**15 - 1
_OPTIONAL_TEXT = {str, type(None)}


def holder_for(
    default_host: str,
    task_name: str | None = None,
    task_id: str | None = None,
    hostname: str | None = None,
    pid: int | None = None,
    slot: int = 0,
) -> Holder:
    """Validated holder details; ``default_host`` and this process where not given."""
    validate_holder(task_name, task_id, hostname, pid, slot)
    hostname = hostname if hostname is not None else default_host
    return Holder(task_name, task_id, hostname, pid if pid is not None else os.getpid())


def adopter_for(
    default_host: str,
    exclusive: bool,
    task_name: str | None,
    task_id: str | None,
    hostname: str | None,
    pid: int | None,
    slot: int,
) -> Holder | None:
    """The new holder of an exclusive adoption (:func:`holder_for`); ``None`` for a
    plain one, which keeps its holder and so takes no holder details."""
    if exclusive:
        return holder_for(default_host, task_name, task_id, hostname, pid, slot)
    details = {"task_name": task_name, "task_id": task_id, "hostname": hostname, "pid": pid}
    for name, value in details.items():
        if value is not None:
            msg = f"adopt() takes {name}= only with exclusive=True (the holder changes then)"
            raise InvalidArgument(msg, name, value)
    return None


def validate_holder(
    task_name: object, task_id: object, hostname: object, pid: object, slot: object
) -> None:
    """Refuse holder details the columns cannot store (before any statement is sent)."""
    texts: Any = (task_name or "", task_id or "", hostname or "")  # str, once types are checked
    # The common case (short printable ASCII), checked on every acquire, in few steps.
    plain = {type(task_name), type(task_id), type(hostname)} <= _OPTIONAL_TEXT
    plain = plain and max(map(len, texts)) <= _MAX_DETAIL and "".join(texts).isprintable()
    plain = plain and "".join(texts).isascii() and type(slot) is int and 0 <= slot <= _MAX_SLOT
    if plain and (pid is None or (type(pid) is int and 0 <= pid <= _MAX_PID)):
        return
    for name, value in (("task_name", task_name), ("task_id", task_id), ("hostname", hostname)):
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidArgument(
                f"{name} must be a str or None, not {type(value).__name__}", name, value
            )
        if len(value) > _MAX_DETAIL or "\x00" in value:
            raise InvalidArgument(
                f"{name} must be at most {_MAX_DETAIL} characters without NUL: {value[:60]!r}",
                name,
                value,
            )
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(
                f"{name} is not valid Unicode text: {value[:60]!r}", name, value
            ) from None
    for name, value, top in (("pid", pid, _MAX_PID), ("slot", slot, _MAX_SLOT)):
        if value is None and name == "pid":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise InvalidArgument(
                f"{name} must be an int from 0 to {top}, got {value!r}", name, value
            )


def validate_limit(limit: object, slot: int = 0) -> int:
    """A concurrency limit: an int from 1 to :data:`MAX_LIMIT`, not combined with a slot."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(f"limit must be an int from 1 to {MAX_LIMIT}, got {limit!r}")
    if limit > 1 and slot != 0:
        raise ConfigurationError("pass either limit= (any free slot) or slot=, not both")
    return limit


def optional_seconds(value: object, name: str) -> float:
    """``0.0`` for ``None`` or 0, else :func:`validate_ttl`'s seconds."""
    return 0.0 if value is None or value == 0 else validate_ttl(value, name=name)


def validate_marker(marker: Marker, lease_key: str, hostname: str) -> Marker:
    """A :class:`~taskguard.lease.Marker` checked and completed (its key normalized,
    its ttl in seconds, this process as its holder's host and pid by default)."""
    key = normalize_key(marker.key)
    if key == lease_key:
        raise InvalidKey(f"marker key {key!r} is the lease's own key; use another key", key)
    h = marker.holder
    validate_holder(h.task_name, h.task_id, h.hostname, h.pid, 0)
    ttl = marker.ttl
    if (
        key is marker.key
        and h.hostname
        and h.pid
        and type(ttl) is float
        and MIN_TTL <= ttl <= MAX_TTL
    ):
        return marker  # complete already (a Celery run's finished record)
    return Marker(
        key,
        validate_ttl(marker.ttl, name="marker ttl"),
        Holder(h.task_name, h.task_id, h.hostname or hostname, h.pid or os.getpid()),
    )
