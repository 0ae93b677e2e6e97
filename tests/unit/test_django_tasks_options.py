"""@guarded refuses bad options when the task is defined, naming the task and the fix."""

from __future__ import annotations

from typing import Any

import pytest

from taskguard.exceptions import ConfigurationError

guarded = pytest.importorskip("taskguard.contrib.django_tasks").guarded

pytestmark = pytest.mark.django_tasks


def fetch(feed_url: str, batch: str = "") -> None:
    pass


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"lock": "queued"}, "lock='queued' is not one of"),
        ({"on_conflict": "coalesce"}, "on_conflict='coalesce' is not supported by django.tasks"),
        ({"on_conflict": "existing"}, "so it needs lock='queue' or lock='queue_and_run'"),
        ({"key": "feed:{url}"}, "refers to 'url', which is not an argument"),
        ({"ttl": -1}, "ttl"),
        ({"rate": "1/m"}, "rate= is not supported by django.tasks"),
        ({"ttl_": 1}, "unknown taskguard option(s) ['ttl_']"),
    ],
)
def test_bad_options_fail_at_definition(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError) as failed:
        guarded(fetch, **options)
    assert words in str(failed.value) and "fetch" in str(failed.value)


def test_takes_context_is_not_part_of_the_key() -> None:
    def with_context(context: object, feed_url: str) -> None:
        pass

    spec = guarded(key="feed:{feed_url}")(with_context).taskguard
    assert spec.skip_first and spec.key(("ctx", "https://x"), {}) == "feed:https://x"
    assert (
        spec.opts.deriver.derive(("https://x",), {}) == "feed:https://x"
    )  # at enqueue: no context
