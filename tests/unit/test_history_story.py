"""history.story(): which grants were taken over, read from the recorded facts."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from taskguard.history import LockEvent, story
from taskguard.lease import Holder

T0 = datetime(2026, 11, 26, tzinfo=timezone.utc)


def _event(id_: int, seconds: float, event: str, owner: str, token: int) -> LockEvent:
    return LockEvent(
        id=id_,
        at=T0 + timedelta(seconds=seconds),
        key="k",
        slot=0,
        event=event,
        owner=owner,
        token=token,
        duration=None,
        holder=Holder(),
        detail=None,
    )


def _taken_over(events: list[LockEvent]) -> list[str | None]:
    return [e.owner for e in story(events) if e.event == "taken_over"]


def test_a_lease_its_holder_saw_expire_before_the_next_grant_was_not_taken_over() -> None:
    events = [
        _event(1, 0, "acquired", "a", 1),
        _event(2, 60, "lost", "a", 1),
        _event(3, 3600, "acquired", "b", 2),
    ]
    assert _taken_over(events) == []


def test_a_lease_lost_after_the_next_grant_was_taken_over() -> None:
    events = [
        _event(1, 0, "acquired", "a", 1),
        _event(2, 30, "acquired", "b", 2),
        _event(3, 31, "lost", "a", 1),
    ]
    assert _taken_over(events) == ["a"]


def test_a_release_recorded_after_the_next_grant_is_still_a_release() -> None:
    events = [
        _event(1, 0, "acquired", "a", 1),
        _event(2, 1.0, "acquired", "b", 2),
        _event(3, 1.0002, "released", "a", 1),
    ]
    assert _taken_over(events) == []


def test_a_grant_that_was_never_ended_was_taken_over() -> None:
    events = [_event(1, 0, "acquired", "a", 1), _event(2, 40, "acquired", "b", 2)]
    assert _taken_over(events) == ["a"]
