"""The lease a message hands over (issue 42): its compact form and the dict a version
before it published, read the same way."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from taskguard.celery.message import HEADER, JOIN, Handed, Header, carry
from taskguard.lease import Lease

AT = datetime(2026, 12, 2, 2, 30, 1, 123456, tzinfo=timezone.utc)


def lease(min_hold: float = 0.0, slot: int = 0) -> Lease:
    return Lease("feed:a b", "0f" * 16, 41, AT, AT + timedelta(seconds=90.5), 90.5, slot, min_hold)


@pytest.mark.parametrize(("min_hold", "slot"), [(0.0, 0), (12345.678901, 3)])
def test_the_compact_form_round_trips(min_hold: float, slot: int) -> None:
    given = lease(min_hold, slot)
    value = carry(given)
    assert isinstance(value, str) and JOIN not in value
    handed = Handed.of(value)
    assert (handed.owner, handed.slot, handed.min_hold, handed.token) == (
        given.owner,
        slot,
        min_hold,
        41,
    )
    assert handed.alternate is None
    assert handed.lease(given.key) == given
    assert Handed.of(carry(given, "ab" * 16)).alternate == "ab" * 16


def test_a_queue_phase_header_is_one_string() -> None:
    given = lease()
    header = Header(given.key, lease=carry(given))
    published = header.to_message()
    assert published == f"{given.key}{JOIN}{carry(given)}"
    assert Header(given.key).to_message() == given.key  # the key alone, as before
    # Read back from a worker's request (an attribute) and from eager headers alike.
    assert Header.of(SimpleNamespace(**{HEADER: published})) == header
    assert Header.of(SimpleNamespace(headers={HEADER: published})) == header
    assert Header.of({HEADER: published}) == header
    # A retry's header (via="retry") stays a dict, carrying the compact lease.
    retry = header._replace(via="retry")
    as_dict = retry.to_message()
    assert as_dict == {"key": given.key, "via": "retry", "lease": carry(given)}
    assert isinstance(as_dict, dict) and Header.from_dict(as_dict) == retry


def test_a_dict_header_from_a_version_before_is_read_alike() -> None:
    """A message published before the compact form (``Lease.to_dict()`` in a dict
    header), still queued during a rolling upgrade."""
    given = lease(2.5, 1)
    old = {"v": 1, "key": given.key, "via": "enqueue", "lease": given.to_dict()}
    header = Header.of(SimpleNamespace(**{HEADER: old}))
    assert header.key == given.key and header.lease == given.to_dict()
    assert header.lease is not None
    assert Handed.of(header.lease) == Handed.of(carry(given))
    assert Handed.of(header.lease).lease(given.key) == given
    deferred = {**given.to_dict(), "alternate": "cd" * 16}  # a copy put off by an outage
    assert Handed.of(deferred).alternate == "cd" * 16


@pytest.mark.parametrize("value", ["", "owner 0 0.0", {"owner": "x"}, "o x 0 1 a b"])
def test_a_malformed_lease_raises_what_callers_catch(value: object) -> None:
    with pytest.raises((KeyError, TypeError, ValueError)):
        Handed.of(value).lease("k")  # type: ignore[arg-type]
