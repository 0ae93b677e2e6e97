"""taskguard's exceptions keep their type and fields through Celery result backends."""

from __future__ import annotations

import pickle
from datetime import datetime, timezone

import pytest
from celery import Celery

from taskguard import AlreadyLocked, Holder, LeaseLost, LockHeld, LockInfo, TaskGuardError

NOW = datetime(2026, 11, 22, tzinfo=timezone.utc)
HOLDER = LockInfo("k", 0, "abc", 7, NOW, NOW, Holder("t", "id1", "h", 1), NOW)


@pytest.mark.parametrize("serializer", ["json", "pickle"])
@pytest.mark.parametrize(
    "exc",
    [AlreadyLocked("k", HOLDER), LockHeld("k", None), LeaseLost("k", "abc", "taken over")],
    ids=["already-locked", "lock-held", "lease-lost"],
)
def test_round_trip_through_a_result_backend(serializer: str, exc: TaskGuardError) -> None:
    app = Celery(set_as_current=False)
    app.conf.result_serializer = serializer
    app.conf.accept_content = ["json", "pickle"]
    app.conf.result_accept_content = ["json", "pickle"]
    backend = app.backend
    back = backend.exception_to_python(backend.prepare_exception(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert back.key == "k"  # type: ignore[attr-defined]


def test_pickle_keeps_the_holder() -> None:
    back = pickle.loads(pickle.dumps(AlreadyLocked("k", HOLDER)))
    assert back.holder == HOLDER and back.expires_at == NOW
    assert "owner abc" in str(back) and "id id1" in str(back)
