"""``key=""`` is refused when the task is decorated, naming the task (issue 16, item 7)."""

from __future__ import annotations

import pytest
from celery import Celery

from taskguard import ConfigurationError, guarded_task


def test_an_empty_key_template_is_refused_naming_the_task() -> None:
    app = Celery("empty_key", set_as_current=False)
    with pytest.raises(ConfigurationError) as info:

        @guarded_task(app=app, name="shop.import_feed", key="")
        def import_feed(feed_url: str) -> None:
            """Never defined: its key is empty."""

    assert "shop.import_feed" in str(info.value) and "key=''" in str(info.value)
