"""Key and TTL validation (no database)."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taskguard import InvalidKey, InvalidTTL
from taskguard.validation import MAX_KEY_LENGTH, MAX_TTL, MIN_TTL, normalize_key, validate_ttl


def test_short_keys_are_stored_verbatim() -> None:
    assert normalize_key("feed:https://example.org/rss") == "feed:https://example.org/rss"
    assert normalize_key("x" * MAX_KEY_LENGTH) == "x" * MAX_KEY_LENGTH


def test_long_keys_get_readable_prefix_and_digest() -> None:
    long = "feed:" + "a" * 1000
    stored = normalize_key(long)
    assert len(stored) == MAX_KEY_LENGTH
    assert stored.startswith("feed:aaaa")
    assert stored == normalize_key(long)  # deterministic
    assert normalize_key(long + "b") != stored


@pytest.mark.parametrize("bad", ["", " ", "  \t\n", "a\x00", b"bytes", 1, None, "\udcff"])
def test_bad_keys(bad: object) -> None:
    with pytest.raises(InvalidKey) as err:
        normalize_key(bad)
    assert isinstance(err.value, ValueError) and err.value.key == bad


@given(st.text(min_size=1))
def test_any_text_is_accepted_or_rejected_clearly(key: str) -> None:
    try:
        stored = normalize_key(key)
    except InvalidKey:
        assert "\x00" in key or any(0xD800 <= ord(c) <= 0xDFFF for c in key) or not key.strip()
    else:
        assert 0 < len(stored) <= MAX_KEY_LENGTH
        stored.encode("utf-8")


def test_blank_key_error_is_one_line() -> None:
    with pytest.raises(InvalidKey) as err:
        normalize_key("   ")
    assert "\n" not in str(err.value) and "blank" in str(err.value)


def test_keys_are_normalized_to_nfc() -> None:
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert normalize_key(decomposed) == normalize_key(composed) == composed
    long = decomposed + "x" * MAX_KEY_LENGTH
    assert normalize_key(long) == normalize_key(composed + "x" * MAX_KEY_LENGTH)


@pytest.mark.parametrize("ttl", [MIN_TTL, 1, 2.5, MAX_TTL, timedelta(minutes=5)])
def test_good_ttls(ttl: object) -> None:
    seconds = validate_ttl(ttl)
    assert MIN_TTL <= seconds <= MAX_TTL


@pytest.mark.parametrize(
    "ttl", [0, -1, 0.0001, math.nan, math.inf, -math.inf, MAX_TTL * 2, "5", None, True]
)
def test_bad_ttls(ttl: object) -> None:
    with pytest.raises(InvalidTTL) as err:
        validate_ttl(ttl)
    assert "ttl" in str(err.value)
