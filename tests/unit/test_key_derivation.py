"""Key derivation for @guarded_task: every normalisation rule, plus the round trips
a Celery message puts arguments through (JSON via kombu, pickle)."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import inspect
import pickle
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu.utils import json as kombu_json

from taskguard import ConfigurationError, InvalidKey
from taskguard.celery.options import GuardOptions, signature_of
from taskguard.key_derivation import KeyDeriver, args_digest, canonical, canonical_json
from taskguard.validation import MAX_KEY_LENGTH


def fetch(feed_url: str, force: bool = False, *, limit: int = 10) -> None: ...


def deriver(fun: Any = fetch, **options: Any) -> KeyDeriver:
    return KeyDeriver("tasks.fetch", inspect.signature(fun), **options)


def json_round_trip(value: Any) -> Any:
    return kombu_json.loads(kombu_json.dumps(value))


# -- default key: task name + digest of the bound arguments ------------------------------


def test_default_key_is_task_name_and_digest() -> None:
    key = deriver().derive(("https://a",), {})
    name, _, digest = key.partition(":")
    assert name == "tasks.fetch"
    assert len(digest) == 32 and int(digest, 16) >= 0


def test_positional_and_keyword_calls_give_the_same_key() -> None:
    d = deriver()
    assert d.derive(("u", True), {}) == d.derive((), {"feed_url": "u", "force": True})
    assert d.derive(("u",), {"force": True}) == d.derive((), {"force": True, "feed_url": "u"})


def test_defaults_are_filled_in() -> None:
    d = deriver()
    plain = d.derive(("u",), {})
    assert plain == d.derive(("u", False), {})
    assert plain == d.derive(("u",), {"limit": 10})
    assert plain != d.derive(("u",), {"limit": 11})


def test_different_arguments_give_different_keys() -> None:
    d = deriver()
    assert d.derive(("a",), {}) != d.derive(("b",), {})
    assert d.derive(("a",), {}) != d.derive(("a", True), {})


def test_different_tasks_with_the_same_arguments_differ() -> None:
    a = KeyDeriver("tasks.a", inspect.signature(fetch))
    b = KeyDeriver("tasks.b", inspect.signature(fetch))
    assert a.derive(("u",), {}) != b.derive(("u",), {})


def test_tuple_and_list_are_the_same() -> None:
    def f(items: Any) -> None: ...

    d = deriver(f)
    assert d.derive(((1, 2, (3, 4)),), {}) == d.derive(([1, 2, [3, 4]],), {})
    assert d.derive(([1, 2],), {}) != d.derive(([2, 1],), {})  # order of a list matters


def test_dict_order_does_not_matter() -> None:
    def f(options: Any) -> None: ...

    d = deriver(f)
    assert d.derive(({"a": 1, "b": {"x": 1, "y": 2}},), {}) == d.derive(
        ({"b": {"y": 2, "x": 1}, "a": 1},), {}
    )


def test_non_string_dict_keys_match_their_json_round_trip() -> None:
    def f(mapping: Any) -> None: ...

    d = deriver(f)
    original = {1: "a", 2.5: "b", None: "d"}
    assert json_round_trip(original) == {"1": "a", "2.5": "b", "null": "d"}
    assert d.derive((original,), {}) == d.derive((json_round_trip(original),), {})
    flags = {True: "yes", False: "no"}
    assert d.derive((flags,), {}) == d.derive((json_round_trip(flags),), {})


def test_colliding_dict_keys_are_refused() -> None:
    def f(mapping: Any) -> None: ...

    with pytest.raises(InvalidKey, match="collide"):
        deriver(f).derive(({1: "a", "1": "b"},), {})


def test_var_positional_and_var_keyword() -> None:
    def f(first: Any, *rest: Any, **extra: Any) -> None: ...

    d = deriver(f)
    assert d.derive((1, 2, 3), {"b": 1, "a": 2}) == d.derive((1, 2, 3), {"a": 2, "b": 1})
    assert d.derive((1, 2, 3), {}) != d.derive((1, 3, 2), {})


def test_bound_task_signature_drops_self() -> None:
    def bound(self: Any, feed_url: str) -> None: ...

    d = KeyDeriver("t", signature_of(bound, bind=True))
    assert d.derive(("u",), {}) == d.derive((), {"feed_url": "u"})
    with pytest.raises(ConfigurationError, match="first argument"):
        signature_of(lambda: None, bind=True)


def test_wrong_arguments_raise_type_error_naming_the_task() -> None:
    with pytest.raises(TypeError, match=r"tasks\.fetch\(\)"):
        deriver().derive((), {})
    with pytest.raises(TypeError, match="unexpected keyword"):
        deriver().derive(("u",), {"nope": 1})


# -- canonical forms of non-JSON values ----------------------------------------------------


class Colour(enum.Enum):
    RED = "red"


@dataclass
class Point:
    x: int
    y: int


def test_canonical_spellings() -> None:
    when = dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    uid = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert canonical(when) == when.isoformat()
    assert canonical(dt.date(2024, 1, 2)) == "2024-01-02"
    assert canonical(uid) == str(uid)
    assert canonical(decimal.Decimal("1.10")) == "1.10"
    assert canonical(b"\x00\xff") == "base64:AP8="
    assert canonical(Colour.RED) == "red"
    assert canonical(Point(1, 2)) == {"x": 1, "y": 2}
    assert canonical(dt.timedelta(minutes=1)) == 60.0
    assert canonical({3, 1, 2}) == [1, 2, 3]
    assert canonical(frozenset({"b", "a"})) == ["a", "b"]


def test_datetime_survives_the_kombu_json_round_trip() -> None:
    def f(when: Any) -> None: ...

    when = dt.datetime(2024, 1, 2, 3, 4, 5, 600, tzinfo=dt.timezone.utc)
    d = deriver(f)
    assert d.derive((when,), {}) == d.derive((json_round_trip(when),), {})
    assert d.derive((when,), {}) == d.derive((when.isoformat(),), {})


def test_set_order_does_not_matter() -> None:
    def f(tags: Any) -> None: ...

    d = deriver(f)
    assert d.derive(({"b", "a", "c"},), {}) == d.derive(({"c", "a", "b"},), {})


def test_objects_without_a_canonical_form_are_refused_by_name() -> None:
    def f(feed: Any, conn: Any = None) -> None: ...

    with pytest.raises(InvalidKey, match=r"argument value\['conn'\]\[0\] is a object"):
        deriver(f).derive(("u",), {"conn": [object()]})
    with pytest.raises(TypeError):
        canonical(object())


def test_digest_does_not_depend_on_argument_order() -> None:
    assert args_digest({"a": 1, "b": [1, 2]}) == args_digest({"b": (1, 2), "a": 1})
    assert canonical_json({"b": 1, "a": (1,)}) == '{"a":[1],"b":1}'


# -- round trips (property based) ----------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
dict_keys = st.one_of(st.text(max_size=6), st.integers(-100, 100), st.booleans())
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(dict_keys, children, max_size=4),
    ),
    max_leaves=12,
)


def _json_safe_keys(value: Any) -> bool:
    # {1: x, "1": y} cannot survive JSON (both become "1"); derivation refuses it.
    if isinstance(value, dict):
        names = [k if isinstance(k, str) else kombu_json.dumps(k) for k in value]
        return len(set(names)) == len(names) and all(map(_json_safe_keys, value.values()))
    if isinstance(value, (list, tuple)):
        return all(map(_json_safe_keys, value))
    return True


@settings(max_examples=100, deadline=None)
@given(st.lists(values, max_size=3), st.dictionaries(st.sampled_from("xyz"), values, max_size=3))
def test_key_survives_json_and_pickle_round_trips(args: list[Any], kwargs: dict[str, Any]) -> None:
    if not _json_safe_keys([args, kwargs]):
        return

    def f(*args: Any, **kwargs: Any) -> None: ...

    d = deriver(f)
    key = d.derive(tuple(args), kwargs)
    body = json_round_trip([args, kwargs])
    assert d.derive(body[0], body[1]) == key
    args2, kwargs2 = pickle.loads(pickle.dumps((args, kwargs)))
    assert d.derive(args2, kwargs2) == key


# -- key="template" ----------------------------------------------------------------------


def test_template_over_argument_names() -> None:
    d = deriver(key="feed:{feed_url}")
    assert d.derive(("https://a",), {}) == "feed:https://a"
    assert d.derive((), {"feed_url": "https://a", "force": True}) == "feed:https://a"


def test_template_sees_defaults_attributes_and_items() -> None:
    def f(user: Any, region: str = "eu", opts: Any = None) -> None: ...

    d = deriver(f, key="{region}:{user.id}:{opts[kind]}")

    class User:
        id = 7

    assert d.derive((User(),), {"opts": {"kind": "x"}}) == "eu:7:x"


def test_template_writes_containers_canonically() -> None:
    def f(ids: Any) -> None: ...

    d = deriver(f, key="batch:{ids}")
    assert d.derive(((1, 2),), {}) == "batch:[1,2]" == d.derive(([1, 2],), {})
    assert d.derive(({"b": 1, "a": 2},), {}) == 'batch:{"a":2,"b":1}'


def test_template_without_fields_is_one_global_key() -> None:
    assert deriver(key="nightly-report").derive(("x",), {}) == "nightly-report"


def test_template_can_use_names_from_var_keyword() -> None:
    def f(**payload: Any) -> None: ...

    d = deriver(f, key="user:{user_id}")
    assert d.derive((), {"user_id": 5, "other": 1}) == "user:5"
    with pytest.raises(InvalidKey, match="did not pass"):
        d.derive((), {"other": 1})


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("feed:{url}", "'url', which is not an argument"),
        ("feed:{}", "positional fields"),
        ("feed:{0}", "positional fields"),
        ("feed:{feed_url", "malformed"),
        ("x\x00{feed_url}", "NUL"),
        ("x\udcff{feed_url}", "lone surrogate"),
    ],
)
def test_bad_templates_fail_at_definition(template: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        deriver(key=template)


def test_long_keys_are_shortened_deterministically() -> None:
    d = deriver(key="feed:{feed_url}")
    long_url = "https://example.com/" + "x" * 400
    key = d.derive((long_url,), {})
    assert len(key) <= MAX_KEY_LENGTH
    assert key == d.derive((long_url,), {}) and key.startswith("feed:https://example.com/")


# -- key=callable --------------------------------------------------------------------------


def test_callable_key_gets_the_call_with_defaults_filled_in() -> None:
    seen: list[tuple[Any, ...]] = []

    def key(feed_url: str, force: bool, *, limit: int) -> str:
        seen.append((feed_url, force, limit))
        return f"feed:{feed_url.lower()}"

    d = deriver(key=key)
    assert d.derive(("HTTPS://A",), {}) == "feed:https://a"
    assert d.derive((), {"feed_url": "https://a", "limit": 3}) == "feed:https://a"
    assert seen == [("HTTPS://A", False, 10), ("https://a", False, 3)]


def test_callable_key_must_return_a_non_empty_str() -> None:
    with pytest.raises(InvalidKey, match="returned int"):
        deriver(key=lambda *a, **k: 5).derive(("u",), {})
    with pytest.raises(InvalidKey, match="empty"):
        deriver(key=lambda *a, **k: "").derive(("u",), {})


def test_key_must_be_str_or_callable() -> None:
    with pytest.raises(ConfigurationError, match="template string or a callable"):
        deriver(key=5)  # type: ignore[arg-type]


# -- key_args --------------------------------------------------------------------------------


def test_key_args_digest_only_the_named_arguments() -> None:
    d = deriver(key_args=["feed_url"])
    assert d.derive(("u", True), {"limit": 1}) == d.derive(("u",), {})
    assert d.derive(("u",), {}) != d.derive(("v",), {})
    assert d.derive(("u",), {}).startswith("tasks.fetch:")
    # the subset digest is not the all-arguments digest
    assert d.derive(("u",), {}) != deriver().derive(("u",), {})


def test_key_args_validation() -> None:
    with pytest.raises(ConfigurationError, match="'nope', which is not an argument"):
        deriver(key_args=["nope"])
    with pytest.raises(ConfigurationError, match="list of argument names"):
        deriver(key_args="feed_url")
    with pytest.raises(ConfigurationError, match="repeats"):
        deriver(key_args=["feed_url", "feed_url"])
    with pytest.raises(ConfigurationError, match="not both"):
        deriver(key="x", key_args=["feed_url"])


# -- the other options, validated together -----------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock": "always"}, "lock='always' is not one of"),
        ({"on_conflict": "block"}, "on_conflict='block' is not one of"),
        ({"on_conflict": "existing"}, "needs lock='queue'"),
        ({"queue_ttl": 5}, "queue_ttl applies"),
        ({"retry_countdown": 5}, "retry_countdown applies"),
        ({"on_conflict": "retry", "retry_countdown": -1}, "non-negative"),
        ({"ttl": 0}, "ttl must be at least"),
        ({"ttl": "5"}, "ttl must be a number"),
    ],
)
def test_option_errors_name_the_task_and_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as info:
        GuardOptions.build("tasks.fetch", inspect.signature(fetch), **options)
    assert "tasks.fetch" in str(info.value)


def test_valid_options() -> None:
    opts = GuardOptions.build(
        "t",
        inspect.signature(fetch),
        lock="queue_and_run",
        on_conflict="existing",
        ttl=dt.timedelta(seconds=30),
        queue_ttl=60,
    )
    assert (opts.ttl, opts.queue_ttl, opts.locks_queue, opts.locks_run) == (30.0, 60.0, True, True)
