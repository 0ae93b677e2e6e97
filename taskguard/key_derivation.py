"""Keys derived from a call's arguments (:class:`KeyDeriver`: framework-neutral,
used by every integration).

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
import string
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from taskguard.exceptions import ConfigurationError, InvalidKey
from taskguard.validation import check_key_text, normalize_key

__all__ = ["KeyDeriver", "KeyOption", "canonical"]


#: Hex characters of sha256 kept in a derived key (128 bits). Not the digest of an
#: over-long key (:mod:`taskguard.validation`, 160 bits): each is part of a stored
#: key, so changing either would give a call a new key, and the old and new
#: versions of a deploy would not exclude each other.
_DIGEST_CHARS = 32

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
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]


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
