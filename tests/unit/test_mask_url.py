"""Database URLs in every output hide their password, wherever the URL carries it."""

from __future__ import annotations

import pytest

from taskguard.exceptions import ConfigurationError
from taskguard.urls import EXPECTED_FORM, mask_text, mask_url, parse_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://app:s3cret@db:5432/app", "postgresql+psycopg://app:***@db:5432/app"),
        ("postgresql+psycopg://app:p%40ss@db/app", "postgresql+psycopg://app:***@db/app"),
        (
            "postgresql+psycopg://app@db/app?password=s3cret&sslmode=require",
            "postgresql+psycopg://app@db/app?password=***&sslmode=require",
        ),
        (
            "postgresql+psycopg://app@db/app?PASSWORD=s3cret",
            "postgresql+psycopg://app@db/app?PASSWORD=***",
        ),
        ("sqlite:////tmp/locks.sqlite", "sqlite:////tmp/locks.sqlite"),
    ],
)
def test_passwords_are_masked(url: str, shown: str) -> None:
    assert mask_url(url) == shown
    assert "s3cret" not in mask_url(url)


def test_an_unparseable_url_is_not_echoed() -> None:
    assert mask_url("not a url :// s3cret") == "<unparseable database URL>"


@pytest.mark.parametrize(
    ("text", "url", "shown"),
    [
        # Issue 33, defect 5: the password's text was replaced wherever it occurred.
        (
            "lock database postgresql+psycopg://postgres:postgres@127.0.0.1:1/x unavailable",
            "postgresql+psycopg://postgres:postgres@127.0.0.1:1/x",
            "lock database postgresql+psycopg://postgres:***@127.0.0.1:1/x unavailable",
        ),
        (
            'postgresql+psycopg://nobody:x@db/x: role "nobody" does not exist',
            "postgresql+psycopg://nobody:x@db/x",
            'postgresql+psycopg://nobody:***@db/x: role "nobody" does not exist',
        ),
        (
            "postgresql+psycopg://app:127@127.0.0.1:5432/app refused",
            None,
            "postgresql+psycopg://app:***@127.0.0.1:5432/app refused",
        ),
        # Any URL in the text, also one the message does not quote as given.
        (
            "broker amqp://guest:guest@localhost:5672// and redis://:s3cret@r:6379/0",
            None,
            "broker amqp://guest:***@localhost:5672// and redis://:***@r:6379/0",
        ),
        (
            "url 'postgresql+psycopg://app@db/app?sslmode=require&Password=s3cret' failed",
            None,
            "url 'postgresql+psycopg://app@db/app?sslmode=require&Password=***' failed",
        ),
        (
            "kombu's amqp://guest:**@localhost:5672//",
            None,
            "kombu's amqp://guest:**@localhost:5672//",
        ),
        # A password the patterns cannot delimit: the URL given is replaced whole.
        (
            "cannot use 'postgresql+psycopg://u:se cret@h/d': x",
            "postgresql+psycopg://u:se cret@h/d",
            "cannot use 'postgresql+psycopg://u:***@h/d': x",
        ),
        ("no URL here: password x", "sqlite:///x", "no URL here: password x"),
    ],
)
def test_only_the_password_of_urls_in_a_text_is_masked(
    text: str, url: str | None, shown: str
) -> None:
    assert mask_text(text, url) == shown


@pytest.mark.parametrize(
    ("url", "seen"),
    [
        ("postgres//app:s3cret@db/app", "'postgres' not followed by '://'"),
        ("sqlite:locks.db", "'sqlite' not followed by '://'"),
        ("mysql://app:s3cret@db:port/app", "scheme 'mysql', a port that is no number"),
        ("://app:s3cret@db/app", "no SCHEME:// at its start"),
    ],
)
def test_an_unparseable_url_is_refused_with_its_scheme_and_the_form_expected(
    url: str, seen: str
) -> None:
    """Issue 41, defect 8d: the error said only "'<unparseable database URL>': Could not
    parse SQLAlchemy URL from given URL string" (a bad port: a bare int() ValueError)."""
    with pytest.raises(ConfigurationError) as err:
        parse_url(url)
    text = str(err.value)
    assert f"invalid database URL ({seen})" in text and EXPECTED_FORM in text
    assert "s3cret" not in text
