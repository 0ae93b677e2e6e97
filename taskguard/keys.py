"""Lock keys: validation (what is stored), durations, holder details, and keys
derived from a call's arguments (:class:`KeyDeriver`: framework-neutral, used by
the Celery integration and any other).

Keys are stored as given when they fit; over-long keys are shortened
deterministically (readable prefix + digest) so that every process derives the
same stored key from the same input.

Derived keys come from a call's *bound* arguments.

Three ways to name the lock, all evaluated against the arguments as the task
function would see them (bound to its signature, defaults filled in):

* default: ``<task name>:<digest>`` where the digest covers every argument;
* ``key="feed:{feed_url}"``: a :meth:`str.format` template over argument names;
* ``key=callable``: called like the task (defaults filled in), returns the key;
* ``key_args=[...]``: the default form, digesting only the named arguments.

The digest is over a canonical form that does not change when the message goes
through a serializer and back: tuples and lists are the same, dict order does not
matter, non-string dict keys become the strings JSON would make of them, and
datetimes/UUIDs/Decimals/bytes/sets have one fixed spelling. Values with no
canonical form are refused with an error naming the argument, never hashed by
``repr`` (which can differ between processes).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import inspect
import json
import math
import os
import string
import unicodedata
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

from taskguard.exceptions import ConfigurationError, InvalidArgument, InvalidKey, InvalidTTL
from taskguard.lease import Holder, Marker

__all__ = [
    "DIGEST_CHARS",
    "MAX_KEY_LENGTH",
    "MAX_LIMIT",
    "MAX_TTL",
    "MIN_TTL",
    "KeyDeriver",
    "KeyOption",
    "adopter_for",
    "args_digest",
    "canonical",
    "canonical_json",
    "check_key_text",
    "holder_for",
    "new_owner",
    "normalize_key",
    "normalize_prefix",
    "optional_seconds",
    "validate_holder",
    "validate_limit",
    "validate_marker",
    "validate_ttl",
]

#: Longest key stored verbatim (characters). Matches the column width.
MAX_KEY_LENGTH = 255
_DIGEST_CHARS = 40  # 160 bits of sha256: collisions are not a practical concern
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


# -- keys derived from a call's arguments --------------------------------------------------


#: Hex characters of sha256 kept in a derived key (128 bits).
DIGEST_CHARS = 32

KeyOption = str | Callable[..., Any] | None


class _Uncanonical(TypeError):
    def __init__(self, path: str, value: object) -> None:
        super().__init__(path)
        self.path = path
        self.value = value


def _json_key(key: object, path: str) -> str:
    # The string a JSON round trip turns a mapping key into.
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    if isinstance(key, (uuid.UUID, decimal.Decimal)):
        return str(key)
    if isinstance(key, (dt.date, dt.time)):
        return key.isoformat()
    raise _Uncanonical(f"{path} (a dict key)", key)


def canonical(value: Any, path: str = "value") -> Any:
    """``value`` as plain JSON data with one spelling per meaning (see module doc).

    Raises :class:`TypeError` naming ``path`` for values that have no canonical form.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            name = _json_key(k, path)
            if name in out:
                raise _Uncanonical(f"{path} (keys {name!r} collide once made strings)", value)
            out[name] = canonical(v, f"{path}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        items = [canonical(v, f"{path}{{…}}") for v in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))
    if isinstance(value, enum.Enum):
        return canonical(value.value, path)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, (uuid.UUID, decimal.Decimal)):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "base64:" + base64.b64encode(bytes(value)).decode("ascii")
    dump = getattr(value, "model_dump", None)  # pydantic v2 models
    if callable(dump):
        return canonical(dump(mode="json"), path)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return canonical(fields, path)
    raise _Uncanonical(path, value)


def canonical_json(value: Any) -> str:
    """Compact, key-sorted JSON of :func:`canonical` ``(value)``."""
    return json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def args_digest(arguments: Mapping[str, Any]) -> str:
    """Digest of named arguments (independent of order and of serializer round trips)."""
    text = canonical_json(dict(arguments))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_CHARS]


class _TemplateFormatter(string.Formatter):
    # Containers are written canonically so a tuple and the list a JSON round trip
    # makes of it give the same key; scalars format as usual.
    def format_field(self, value: Any, format_spec: str) -> str:
        if not format_spec and isinstance(value, (list, tuple, dict, set, frozenset)):
            return canonical_json(value)
        return str(super().format_field(value, format_spec))


_FORMATTER = _TemplateFormatter()
#: Argument types str.format formats as the template formatter does.
_SCALARS = {str, int, float, bool}


def _name_of(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__name__", None) or func)


def _field_root(field: str) -> str:
    for i, ch in enumerate(field):
        if ch in ".[":
            return field[:i]
    return field


class KeyDeriver:
    """Computes a task's lock key from its call arguments.

    ``signature`` is the task function's signature as callers see it (without
    ``self`` for ``bind=True`` tasks). Options are checked here, so a bad
    template or unknown argument name fails when the task is defined.
    """

    def __init__(
        self,
        task_name: str,
        signature: inspect.Signature,
        key: KeyOption = None,
        key_args: Iterable[str] | None = None,
    ) -> None:
        self.task_name = task_name
        self.signature = signature
        params = signature.parameters.values()
        self._var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        self._names = [p.name for p in params if p.kind is not p.VAR_KEYWORD]
        #: Calls that pass every argument positionally to a signature of plain
        #: parameters (no defaults, *args, **kwargs or keyword-only) bind without
        #: inspect: the number of them (None: always bind with inspect).
        plain = all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params)
        self._positional = len(self._names) if plain else None
        self.template: str | None = None
        self.func: Callable[..., Any] | None = None
        self.key_args: tuple[str, ...] | None = None
        if key is not None and key_args is not None:
            raise ConfigurationError(
                f"task {task_name}: give key= or key_args=, not both "
                "(key_args selects the arguments of the default, digested key)"
            )
        if isinstance(key, str):
            if not key.strip():
                raise ConfigurationError(
                    f"task {task_name}: key={key!r} is empty: give a template such as "
                    "'feed:{feed_url}', a callable, or leave key out (one lock per arguments)"
                )
            self.template = key
            self._check_template(key)
        elif callable(key):
            self.func = key
            self._check_callable(key)
        elif key is not None:
            raise ConfigurationError(
                f"task {task_name}: key= must be a template string or a callable, "
                f"not {type(key).__name__}"
            )
        if key_args is not None:
            if isinstance(key_args, str):
                raise ConfigurationError(
                    f"task {task_name}: key_args= must be a list of argument names, "
                    f"not the string {key_args!r}"
                )
            names = tuple(key_args)
            for name in names:
                self._check_name(name, "key_args")
            if len(set(names)) != len(names):
                raise ConfigurationError(f"task {task_name}: key_args {names!r} repeats a name")
            self.key_args = names

    # -- validation ----------------------------------------------------------------

    def _check_name(self, name: object, where: str) -> None:
        if not isinstance(name, str):
            raise ConfigurationError(
                f"task {self.task_name}: {where} names must be strings, got {name!r}"
            )
        if name in self._names or self._var_kw is not None:
            return
        known = ", ".join(self._names) or "none"
        raise ConfigurationError(
            f"task {self.task_name}: {where} refers to {name!r}, which is not an argument "
            f"of the task (its arguments: {known})"
        )

    def _key_signature(self) -> inspect.Signature | None:
        try:
            return inspect.signature(self.func) if self.func is not None else None
        except (TypeError, ValueError):  # e.g. some builtins: nothing to check
            return None

    def _check_callable(self, func: Callable[..., Any]) -> None:
        """``key=func`` is called like the task (every argument, defaults filled in):
        refuse a function that cannot take the task's arguments, now."""
        sig = self._key_signature()
        if sig is None:
            return
        params = self.signature.parameters.values()
        given = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        named = {p.name: None for p in params if p.kind is p.KEYWORD_ONLY}
        # A task's *args / **kwargs may bring more at call time: then only what cannot
        # fit any call is refused here (too many arguments, an unknown name).
        varying = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
        try:
            (sig.bind_partial if varying else sig.bind)(*(None for _ in given), **named)
        except TypeError as exc:
            raise ConfigurationError(
                f"task {self.task_name}: key callable {_name_of(func)}{sig} cannot take the "
                f"task's arguments {self.signature} ({exc}); it is called with every "
                "argument of the task, defaults filled in"
            ) from None

    def _check_template(self, template: str) -> None:
        try:
            fields = list(_FORMATTER.parse(template))
        except ValueError as exc:
            raise ConfigurationError(
                f"task {self.task_name}: key template {template!r} is malformed: {exc}"
            ) from None
        try:  # text no call could make a key of: refused now, not at every call
            check_key_text("".join(literal for literal, *_ in fields))
        except InvalidKey as exc:
            raise ConfigurationError(f"task {self.task_name}: key template: {exc}") from None
        for _literal, field, _spec, _conv in fields:
            if field is None:
                continue
            root = _field_root(field)
            if not root or root.isdigit():
                raise ConfigurationError(
                    f"task {self.task_name}: key template {template!r} must name arguments, "
                    "e.g. 'feed:{feed_url}' (positional fields like {} or {0} are not allowed)"
                )
            self._check_name(root, f"key template {template!r}")

    # -- derivation ----------------------------------------------------------------

    def bind(self, args: Iterable[Any] | None, kwargs: Mapping[str, Any] | None) -> Any:
        """The call bound to the signature with defaults applied (TypeError if it
        does not fit, like calling the function would)."""
        try:
            bound = self.signature.bind(*(args or ()), **(kwargs or {}))
        except TypeError as exc:
            raise TypeError(f"{self.task_name}(): {exc}") from None
        bound.apply_defaults()
        return bound

    def _call_key(self, bound: Any) -> Any:
        assert self.func is not None
        try:
            return self.func(*bound.args, **bound.kwargs)
        except TypeError as exc:
            sig = self._key_signature()
            try:
                if sig is not None:
                    sig.bind(*bound.args, **bound.kwargs)
            except TypeError:  # the call does not fit (extra *args or **kwargs)
                raise ConfigurationError(
                    f"task {self.task_name}: key callable {_name_of(self.func)}{sig} cannot "
                    f"take this call's arguments ({exc})"
                ) from None
            raise  # raised inside the key callable: the user's own error

    def _named(self, bound: Any) -> dict[str, Any]:
        named = dict(bound.arguments)
        if self._var_kw is not None:
            extra = named.pop(self._var_kw, {})
            # Names in **kwargs are addressable like parameters (templates, key_args).
            named = {**extra, **named}
        return named

    def derive(self, args: Iterable[Any] | None, kwargs: Mapping[str, Any] | None) -> str:
        """The stored lock key for a call with ``args``/``kwargs``."""
        # The common case (a template, every argument passed by position, each a str
        # or a number): str.format_map formats them as the template formatter does.
        given: Any = args
        fast = self.template is not None and not kwargs and type(given) in (tuple, list)
        if fast and len(given) == self._positional and {type(a) for a in given} <= _SCALARS:
            named = dict(zip(self._names, given, strict=True))
            return normalize_key(str(self.template).format_map(named))
        bound = self.bind(args, kwargs)
        try:
            if self.func is not None:
                raw = self._call_key(bound)
                if not isinstance(raw, str):
                    raise InvalidKey(
                        f"task {self.task_name}: key callable returned "
                        f"{type(raw).__name__}, not str",
                        raw,
                    )
                return normalize_key(raw)
            if self.template is not None:
                return normalize_key(_FORMATTER.vformat(self.template, (), self._named(bound)))
            if self.key_args is not None:
                named = self._named(bound)
                missing = [n for n in self.key_args if n not in named]
                if missing:
                    raise InvalidKey(
                        f"task {self.task_name}: key_args {missing!r} not passed in this call",
                        missing,
                    )
                selected = {n: named[n] for n in self.key_args}
                return normalize_key(f"{self.task_name}:{args_digest(selected)}")
            return normalize_key(f"{self.task_name}:{args_digest(bound.arguments)}")
        except _Uncanonical as exc:
            raise InvalidKey(
                f"task {self.task_name}: cannot derive a lock key: argument {exc.path} is a "
                f"{type(exc.value).__name__}, which has no stable canonical form; pass "
                "key='...{name}...', key=callable or key_args=[...] to name the lock yourself",
                exc.value,
            ) from None
        except KeyError as exc:
            raise InvalidKey(
                f"task {self.task_name}: key template {self.template!r} refers to "
                f"{exc.args[0]!r}, which this call did not pass",
                self.template,
            ) from None
