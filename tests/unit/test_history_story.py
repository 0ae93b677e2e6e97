"""history.story(): which grants were taken over, read from the recorded facts; the
one holder text."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

from taskguard.exceptions import HOLDER_GONE, LockHeld
from taskguard.history import LockEvent, endings, story, what
from taskguard.lease import Holder, describe_holder

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


def test_what_and_endings_tell_one_verdict_per_grant() -> None:
    """Issue 42: the admin words its rows with history.what over history.endings of
    the same story `explain` tells (a lease lost before the next grant is not taken
    over; one never ended is)."""
    events = [
        _event(1, 0, "acquired", "a", 1),
        _event(2, 60, "lost", "a", 1),
        _event(3, 3600, "acquired", "b", 2),
        _event(4, 3700, "acquired", "c", 3),
    ]
    ends = endings(story(events))
    assert {owner: e.event for (_, owner), e in ends.items()} == {"a": "lost", "b": "taken_over"}
    words = [what(e, ends) for e in events]
    assert words == [
        "acquired",
        "lost",
        "acquired; then taken over (lease expired without release)",
        "acquired",
    ]


def test_one_holder_text_and_one_wording_for_a_holder_gone() -> None:
    holder = Holder("tasks.fetch", "id-1", "w1", 42)
    assert holder.describe() == "task tasks.fetch id id-1 on w1 pid 42"
    assert Holder().describe() == ""
    assert describe_holder(None) == HOLDER_GONE
    assert str(LockHeld("k")) == f"lock 'k' is held by {HOLDER_GONE}"
    line = replace(_event(1, 0, "acquired", "a", 1), holder=holder).describe()
    assert f"({holder.describe()})" in line
