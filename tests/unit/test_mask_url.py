"""Database URLs in every output hide their password, wherever the URL carries it."""

from __future__ import annotations

import pytest

from taskguard.urls import mask_url


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
