"""The operators' page (taskguard.web) through Starlette's TestClient against real
databases holding live leases: pages, filters, actions and their guards (read-only,
the authorize hook, CSRF), hostile keys, /healthz."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from html import unescape
from pathlib import Path
from urllib.parse import quote

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, text
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from taskguard import TaskGuard, schema
from taskguard.cli import cli
from taskguard.companions import companion_key
from taskguard.options import Phase
from taskguard.web import basic_auth, create_app

HOSTILE = [
    "<script>alert(1)</script>",
    "rtl\u202egpj.exe",
    "ctl\x1b[31m\r\nforged row\t",
    "a/../b?c=d#e%2F&f",
    "ü" * 10_000,  # stored as a prefix and a digest
]


@pytest.fixture
def guard(db_url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(db_url, history=True)
    yield g
    g.dispose()


@pytest.fixture
def leases(guard: TaskGuard) -> TaskGuard:
    """A held mutex with holder details and one conflict on it, an expired row, a
    companion row, a key under a limit of two with both slots held."""
    assert guard.acquire("feed:1", 300, task_name="app.import_feed", task_id="t-1", pid=41)
    assert guard.try_acquire("feed:1", 300, task_name="app.import_feed").lease is None
    assert guard.acquire("feed:2", 0.05, task_name="app.import_feed")
    assert guard.acquire(companion_key("feed:1", "pending"), 300)
    for _ in range(2):
        assert guard.acquire("report:x", 300, limit=2, task_name="app.report")
    time.sleep(0.3)
    return guard


def _client(guard: TaskGuard, operator: str | None = "alice", **kw: object) -> TestClient:
    actions = operator is not None or "authorize" in kw
    kw.setdefault("authorize", lambda _request: operator)
    return TestClient(create_app(guard, allow_actions=actions, **kw))  # type: ignore[arg-type]


def _token(client: TestClient, path: str) -> tuple[str, str]:
    """The form's action and CSRF token on the page at ``path``."""
    page = client.get(path)
    assert page.status_code == 200, page.text
    action = re.search(r'<form method="post" action="([^"]*)"', page.text)
    token = re.search(r'name="csrf" value="([^"]*)"', page.text)
    assert action and token, page.text
    return unescape(action.group(1)), token.group(1)


def test_pages_render_and_filter(leases: TaskGuard) -> None:
    client = _client(leases, operator=None)
    overview = client.get("/")
    assert overview.status_code == 200
    cards = dict(
        (label.strip(), int(n))
        for n, label in re.findall(r"<b>(\d+)</b>(?:<a[^>]*>)?([^<]+)", overview.text)
    )
    assert cards == {
        "locks held": 3,
        "keys at their limit (of 2 held)": 2,  # feed:1, report:x (both slots)
        "keys with waiters": 0,  # (test_wait.py counts a waiting process)
        "expired rows not yet reaped": 1,
    }
    assert "<svg" in overview.text and "1 conflict(s) in all" in overview.text
    assert "reaper's last run: none recorded in the last day" in overview.text

    held = client.get("/locks").text
    assert "feed:1</a>" in held and "report:x</a>" in held and "feed:2</a>" not in held
    assert "#pending" not in held  # companions only on request
    expired = client.get("/locks", params={"state": "expired"}).text
    assert "feed:2</a>" in expired and "feed:1</a>" not in expired
    by_task = client.get("/locks", params={"task": "report", "state": "all"}).text
    assert "report:x</a>" in by_task and "feed:" not in by_task
    by_prefix = client.get("/locks", params={"prefix": "feed:", "companions": "1"}).text
    assert "feed:1#pending</a>" in by_prefix and "<td>pending run</td>" in by_prefix
    assert client.get("/locks", params={"state": "nope"}).status_code == 400

    rows = client.get("/api/locks", params={"state": "all"}).json()
    assert sorted((r["key"], r["slot"], r["held"]) for r in rows) == [
        ("feed:1", 0, True),
        ("feed:2", 0, False),
        ("report:x", 0, True),
        ("report:x", 1, True),
    ]
    key = client.get("/keys/feed%3A1")
    assert key.status_code == 200
    assert "turned away" in key.text and "app.import_feed" in key.text and "t-1" in key.text
    story = client.get("/api/keys/feed:1").json()
    assert [e["event"] for e in story["events"]] == ["acquired", "conflict"]
    assert story["rows"][0]["task_id"] == "t-1"
    assert client.get("/api/keys/never").status_code == 404
    assert "now: free (no row)" in client.get("/keys/never").text


def _phases_and_slots(html: str) -> list[tuple[str, str, str]]:
    """(key, phase, slots) of each row of a Locks page, sorted."""
    found = re.findall(
        r'<a href="[^"]*">([^<]*)</a></td>.*?<td class="phase">([^<]*)</td>\s*'
        r'<td class="slots">([^<]*)</td>',
        html,
        re.S,
    )
    return sorted(found)


def test_phases_and_slots_shown_filtered_and_counted(guard: TaskGuard, db_url: str) -> None:
    """Issue 44: a lease's phase and its key's slots in use of its recorded limit; rows
    from before those were recorded show "-"; "keys at their limit" uses the limit."""
    assert guard.try_acquire("job:q", 300, task_name="app.job", phase=Phase.QUEUE).lease
    assert guard.try_acquire("job:r", 300, task_name="app.job", phase=Phase.RUN).lease
    for _ in range(2):
        assert guard.acquire("batch:y", 300, limit=3, task_name="app.batch")
    old = guard.acquire("old:z", 300)
    assert old is not None
    engine = create_engine(db_url)
    with engine.begin() as conn:  # a row written before tg0003
        forget = "UPDATE task_locks SET phase = NULL, slots = NULL WHERE owner = :owner"
        conn.execute(text(forget), {"owner": old.owner})
    engine.dispose()
    client = _client(guard, operator=None)

    assert _phases_and_slots(client.get("/locks").text) == [
        ("batch:y", "-", "2 of 3"),
        ("batch:y", "-", "2 of 3"),
        ("job:q", "queue", "1 of 1"),
        ("job:r", "run", "1 of 1"),
        ("old:z", "-", "-"),
    ]
    for phase, keys in (("queue", ["job:q"]), ("run", ["job:r"]), ("none", ["batch:y", "old:z"])):
        page = client.get("/locks", params={"phase": phase}).text
        assert sorted({k for k, _, _ in _phases_and_slots(page)}) == keys, phase
        assert f"<option selected>{phase}</option>" in page
    refused = client.get("/locks", params={"phase": "queue_and_run"})
    assert refused.status_code == 400 and "phase must be one of queue, run, none" in refused.text
    rows = client.get("/api/locks", params={"phase": "run"}).json()
    assert [(r["key"], r["phase"], r["slots"], r["slots_in_use"]) for r in rows] == [
        ("job:r", "run", 1, 1)
    ]
    key = client.get("/keys/batch%3Ay").text
    assert key.count('<td class="slots">2 of 3</td>') == 2
    assert [r["slots_in_use"] for r in client.get("/api/keys/batch:y").json()["rows"]] == [2, 2]
    overview = client.get("/").text
    # job:q and job:r (1 of 1), old:z (no limit recorded: no free row); not batch:y (2 of 3)
    assert "<b>3</b>keys at their limit (of 4 held)" in overview


def test_force_release_needs_a_reason_and_records_the_operator(leases: TaskGuard) -> None:
    client = _client(leases, operator="alice")
    assert "Force-release…" in client.get("/keys/feed:1").text
    action, token = _token(client, "/release?key=feed%3A1")
    refused = client.post(action, data={"csrf": token, "reason": "  "})
    assert refused.status_code == 400 and leases.get("feed:1").held  # type: ignore[union-attr]
    done = client.post(action, data={"csrf": token, "reason": "worker host died"})
    assert done.status_code == 200 and "Force-released" in done.text
    assert not leases.get("feed:1").held  # type: ignore[union-attr]
    last = leases.events("feed:1")[-1]
    assert last.event == "force_released"
    assert last.detail == "ended by alice: worker host died (force_release)"


def test_reap_now(leases: TaskGuard) -> None:
    client = _client(leases)
    action, token = _token(client, "/")
    assert action == "/reap"
    answer = client.post(action, data={"csrf": token})
    assert answer.status_code == 200
    # The reaper's grace (300s) keeps the row that expired a moment ago.
    assert "removed 0 expired lock row(s)" in answer.text
    run = leases.events("taskguard:reaper")[-1]
    assert run.event == "reap" and run.detail and run.detail.endswith("requested by alice")
    card = re.search(r"<b>([^<]*)</b>reaper's last run: ([^<]*)</div>", client.get("/").text)
    assert card and card.group(1).endswith(" ago") and "requested by alice" in card.group(2)


def test_the_chart_counts_conflicts_of_reaped_keys_by_task_and_outcome(guard: TaskGuard) -> None:
    for n in range(3):
        # 2 s: still held when the next lines try it, on a loaded machine too
        assert guard.acquire(f"gone:{n}", 2, task_name="app.sync")
        assert guard.try_acquire(f"gone:{n}", 30, task_name="app.sync").lease is None
    assert guard.acquire("gone:0", 30, task_name="app.sync", wait=0.05) is None  # still held
    assert guard.acquire("kept", 300)
    assert guard.try_acquire("kept", 30, task_name="app.mail").lease is None
    while any(r.held for r in guard.held("gone:", include_expired=True)):
        time.sleep(0.1)
    assert guard.reap(grace=0) == 3  # only "kept" has a row now
    page = _client(guard, operator=None).get("/").text
    assert "5 conflict(s) in all" in page
    rows = re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td><td>(\d+)</td>", page)
    assert rows == [
        ("app.sync", "turned away", "3"),
        ("app.mail", "turned away", "1"),
        ("app.sync", "gave up waiting", "1"),
    ]
    quiet = TaskGuard(guard.engine)  # history off here: the chart reads what others record
    try:
        assert "5 conflict(s) in all" in _client(quiet, operator=None).get("/").text
    finally:
        quiet.dispose()


def test_read_only_shows_no_action_and_refuses_posts(leases: TaskGuard) -> None:
    client = _client(leases, operator=None)
    for path in ("/", "/locks", "/keys/feed:1"):
        page = client.get(path).text
        assert '<form method="post"' not in page and "Force-release" not in page
    token = client.cookies["taskguard_csrf"]
    assert client.get("/release?key=feed:1").status_code == 403
    for path in ("/release?key=feed:1", "/reap"):
        assert client.post(path, data={"csrf": token, "reason": "r"}).status_code == 403
    assert leases.get("feed:1").held  # type: ignore[union-attr]


def test_actions_need_the_hooks_consent_and_a_csrf_token(leases: TaskGuard) -> None:
    allowed = _client(leases)
    action, token = _token(allowed, "/release?key=feed%3A1")
    refusing = _client(leases, authorize=lambda _request: None)
    refusing.cookies.set("taskguard_csrf", token)
    assert refusing.post(action, data={"csrf": token, "reason": "r"}).status_code == 403
    assert allowed.post(action, data={"reason": "r"}).status_code == 403
    assert allowed.post(action, data={"csrf": "x" * 43, "reason": "r"}).status_code == 403
    stranger = _client(leases)  # no cookie of its own: a cross-site form
    assert stranger.post(action, data={"csrf": token, "reason": "r"}).status_code == 403
    assert leases.get("feed:1").held  # type: ignore[union-attr]


def test_basic_auth_names_the_operator(leases: TaskGuard) -> None:
    client = _client(leases, authorize=basic_auth("bob", "s3cret"))
    asked = client.get("/release?key=feed:1")
    assert asked.status_code == 401 and asked.headers["www-authenticate"].startswith("Basic")
    client.auth = ("bob", "wrong")
    assert client.get("/release?key=feed:1").status_code == 401
    client.auth = ("bob", "s3cret")
    action, token = _token(client, "/release?key=feed%3A1")
    assert client.post(action, data={"csrf": token, "reason": "stuck"}).status_code == 200
    assert leases.events("feed:1")[-1].detail == "ended by bob: stuck (force_release)"


@pytest.mark.parametrize("hostile", HOSTILE, ids=["html", "rtl", "controls", "url", "10kB"])
def test_hostile_keys_are_escaped_and_releasable(guard: TaskGuard, hostile: str) -> None:
    lease = guard.acquire(hostile, 300, task_name="<i>t</i>\u202e", task_id="\x1b[2J")
    assert lease is not None
    client = _client(guard)
    listing = client.get("/locks").text
    for page in (listing, client.get("/").text):
        assert "<script>" not in page and "<i>" not in page
        assert "\u202e" not in page and "\x1b" not in page and "\r" not in page
    link = unescape(re.search(r'<td class="key"><a href="([^"]*)"', listing).group(1))  # type: ignore[union-attr]
    key_page = client.get(link)
    assert key_page.status_code == 200 and "\u202e" not in key_page.text
    assert client.get("/api/keys/" + quote(hostile, safe="")).json()["key"] == lease.key
    action, token = _token(client, "/release?key=" + quote(lease.key, safe=""))
    assert client.post(action, data={"csrf": token, "reason": "hostile"}).status_code == 200
    assert not guard.get(hostile).held  # type: ignore[union-attr]


def test_keys_no_database_can_hold_are_refused_in_one_line(guard: TaskGuard) -> None:
    client = _client(guard)
    # A lone surrogate cannot reach the server percent-encoded as UTF-8; NUL is refused.
    assert client.get("/keys/%ED%A0%80").status_code == 200  # decoded as U+FFFD: no row
    answer = client.get("/api/keys/a%00b")
    assert answer.status_code == 400 and "NUL" in answer.json()["error"]
    assert client.get("/keys/%20").status_code == 400


def test_mounted_under_a_prefix(leases: TaskGuard) -> None:
    outer = Starlette(routes=[Mount("/ops/locks", app=create_app(leases))])
    client = TestClient(outer)
    page = client.get("/ops/locks/locks")
    assert page.status_code == 200 and 'href="/ops/locks/keys/feed%3A1"' in page.text
    assert client.get("/ops/locks/keys/feed%3A1").status_code == 200


def test_healthz(db_url: str, guard: TaskGuard, request: pytest.FixtureRequest) -> None:
    ok = TestClient(create_app(guard)).get("/healthz")
    assert ok.status_code == 200 and ok.json()["ok"] is True
    reaper = TestClient(create_app(guard)).get("/healthz?reaper_interval=60")
    assert reaper.status_code == 503 and reaper.json()["reaper"] == "not seen"
    assert reaper.json()["problems"] == ["no reaper run recorded in the last 60s"]
    guard.reap()
    reaper = TestClient(create_app(guard)).get("/healthz?reaper_interval=60")
    assert reaper.status_code == 200 and reaper.json()["reaper"].startswith("ran ")
    quiet = TaskGuard(db_url)  # no history: whether the reaper runs cannot be told
    try:
        unknown = TestClient(create_app(quiet)).get("/healthz?reaper_interval=60")
        assert unknown.status_code == 200 and unknown.json()["reaper"].startswith("unknown")
        assert TestClient(create_app(quiet)).get("/healthz?reaper_interval=0").status_code == 400
    finally:
        quiet.dispose()
    dialect = request.node.callspec.params["db_url"]
    if dialect == "sqlite":
        empty = f"sqlite:///{request.getfixturevalue('tmp_path') / 'empty.sqlite'}"
    else:
        empty = request.getfixturevalue(f"empty_{'pg' if dialect == 'postgresql' else 'maria'}_url")
    behind = TestClient(create_app(empty)).get("/healthz")
    assert behind.status_code == 503 and "not installed" in behind.json()["problems"][0]
    closed = {"postgresql": "postgresql://127.0.0.1:1/x", "mariadb": "mysql://root@127.0.0.1:1/x"}
    if dialect in closed:
        with TestClient(create_app(closed[dialect])) as client:
            started = time.monotonic()
            down = client.get("/healthz")
            assert down.status_code == 503 and "unreachable" in down.json()["problems"][0]
            assert time.monotonic() - started < 30
            assert client.get("/").status_code == 503


def test_the_command_needs_credentials_for_actions(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.sqlite'}"
    result = CliRunner().invoke(cli, ["web", "--database-url", url, "--allow-actions"], env={})
    assert result.exit_code == 2
    assert "TASKGUARD_WEB_USER" in result.output and result.output.count("\n") == 1


def test_mounted_in_a_wsgi_app_through_an_adapter(sqlite_url: str) -> None:
    """Flask, with the ASGI app mounted by werkzeug's dispatcher through a2wsgi (as
    docs/web.md shows): links keep the mount's prefix."""
    from a2wsgi import ASGIMiddleware
    from flask import Flask
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    guard = TaskGuard(sqlite_url)
    try:
        assert guard.acquire("feed:1", 300, task_name="app.import_feed")
        flask_app = Flask(__name__)
        ops = ASGIMiddleware(create_app(guard))  # type: ignore[arg-type]
        flask_app.wsgi_app = DispatcherMiddleware(  # type: ignore[method-assign]
            flask_app.wsgi_app,
            {"/ops/locks": ops},  # type: ignore[dict-item]
        )
        client = flask_app.test_client()
        page = client.get("/ops/locks/locks")
        assert page.status_code == 200 and 'href="/ops/locks/keys/feed%3A1"' in page.text
        key = client.get("/ops/locks/keys/feed%3A1")
        assert key.status_code == 200 and "app.import_feed" in key.text
        assert client.get("/ops/locks/healthz").json["ok"] is True  # type: ignore[index]
    finally:
        guard.dispose()


def test_healthz_behind_hung_and_down(sqlite_url: str) -> None:
    """503 with the schema a revision behind; with a database that accepts the
    connection and never answers, within the guard's call_timeout; with it gone."""
    schema.downgrade(sqlite_url, "-1")
    behind = TestClient(create_app(sqlite_url)).get("/healthz")
    assert (
        behind.status_code == 503
        and f"this taskguard needs {schema.head()}" in (behind.json()["problems"][0])
    )
    with socket.socket() as silent:  # a stopped server behind its port: accepts, says nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"postgresql://postgres@127.0.0.1:{silent.getsockname()[1]}/x"
        guard = TaskGuard(url, call_timeout=2)
        try:
            client = TestClient(create_app(guard))
            started = time.monotonic()
            hung = client.get("/healthz")
            assert hung.status_code == 503 and hung.json()["problems"] == ["no answer within 2s"]
            assert time.monotonic() - started < 10
            silent.close()  # now nothing listens there
            down = client.get("/healthz")
            assert down.status_code == 503 and "unreachable" in down.json()["problems"][0]
        finally:
            guard.dispose()
