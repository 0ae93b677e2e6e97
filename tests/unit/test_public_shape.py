"""Issue 33, frictions: what a user reaches for is where the like of it is."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import taskguard
import taskguard.celery
from taskguard import Holder, LockInfo


def test_is_coalesced_is_exported_where_is_skipped_is() -> None:
    for module in (taskguard, taskguard.celery):
        assert "is_skipped" in module.__all__ and "is_coalesced" in module.__all__
    assert taskguard.is_coalesced is taskguard.celery.pending.is_coalesced
    assert taskguard.celery.is_coalesced({"__taskguard__": "coalesced"})


def test_lock_info_names_its_holder_directly() -> None:
    now = datetime.now(timezone.utc)
    info = LockInfo(
        "k", 0, "o" * 32, 7, now, now + timedelta(seconds=5),
        Holder("tasks.fetch", "id-1", "worker@host", 42), now,
    )  # fmt: skip
    assert (info.task_name, info.task_id, info.hostname, info.pid) == (
        "tasks.fetch", "id-1", "worker@host", 42,
    )  # fmt: skip
