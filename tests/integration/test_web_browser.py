"""The operators' page in a real browser: Debian's Chromium, driven by Playwright,
against `taskguard web` served by uvicorn in its own process, on each database, with
the locks held by separate worker processes (``guard.lock()`` bodies that sleep, and
``lock="queue_and_run"`` jobs through the core's run protocol: one waiting in the
queue, one running).

One browser for the module. ``TASKGUARD_WEB_SCREENSHOTS=docs/images`` writes the
pages' screenshots that docs/web.md shows (from the PostgreSQL run)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from playwright.sync_api import Browser, Dialog, Page, sync_playwright

from taskguard import TaskGuard
from taskguard.options import CELERY
from taskguard.runs import GuardedRun, GuardSpec, enqueue_locked

USER, PASSWORD = "ops", "pw-of-ops"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
HOSTILE = {
    "html": "<script>alert(1)</script>",
    "rtl": "rtl\u202egpj.exe",
    "controls": "ctl\x1b[31m\r\nforged row\t",
    "10kB": "ü" * 5_000,  # 10 kB of UTF-8: stored as a prefix and a digest
}


def _work(url: str, spec: dict[str, Any], ready: Connection, test_end: Connection) -> None:
    """A worker process: takes its locks with guard.lock() and sleeps in the body
    until the test closes its end of ``ready`` (or "dies" at once, releasing none)."""
    test_end.close()  # forked with it: its own copy would keep the pipe open
    guard = TaskGuard(url, history=True)
    with ExitStack() as held:
        for key, ttl, limit, name in spec["locks"]:
            lock = guard.lock(key, ttl, limit=limit, task_name=name, task_id=f"t-{os.getpid()}")
            held.enter_context(lock)
        ready.send("holding")
        if spec.get("die"):
            os._exit(0)
        with suppress(EOFError):
            ready.recv()
    guard.dispose()


def job(item: str) -> None:
    """A guarded job's signature (its bodies are the workers')."""


def _jobs(url: str, spec: dict[str, Any], ready: Connection, test_end: Connection) -> None:
    """A worker process with ``lock="queue_and_run"`` jobs: ``job:queued`` enqueued (its
    message published where nobody consumes it), ``job:running`` enqueued, then run:
    its run adopts the lease and sleeps in its body until the test ends."""
    test_end.close()
    guard = TaskGuard(url, history=True)
    options = {"key": "job:{item}", "ttl": 600, "lock": "queue_and_run"}
    guarded = GuardSpec.of(job, CELERY, options, name="app.job")
    for item in ("queued", "running"):
        enqueue_locked(guarded, None, (), {"item": item}, lambda i=item: f"j-{i}", job_id=str,
                       task_id=f"j-{item}", guard=guard)  # fmt: skip

    def body() -> None:
        ready.send("holding")
        with suppress(EOFError):
            ready.recv()

    GuardedRun(guarded, None, (), {"item": "running"}, task_id="j-running", guard=guard).run(body)
    guard.dispose()


WORKERS = [
    {"locks": [["feed:1", 600, 1, "app.import_feed"], ["report:daily", 600, 2, "app.report"]]},
    {"locks": [["feed:2", 600, 1, "app.import_feed"], ["report:daily", 600, 2, "app.report"]]},
    {"locks": [[k, 600, 1, "<i>app.hostile</i>\u202e"] for k in HOSTILE.values()]},
    {"locks": [["cleanup:old", 1, 1, "app.cleanup"]], "die": True},
    {"jobs": True},
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: scripts/services.sh installs it"
    with sync_playwright() as playwright:
        # Playwright gives each launch a fresh, temporary profile (--user-data-dir).
        found = playwright.chromium.launch(executable_path=chromium, args=FLAGS)
        yield found
        found.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(stack: ExitStack, url: str, *extra: str) -> str:
    port = _free_port()
    env = {**os.environ, "TASKGUARD_WEB_USER": USER, "TASKGUARD_WEB_PASSWORD": PASSWORD}
    command = [sys.executable, "-c", "from taskguard.cli import main; main()", "web"]
    command += ["--database-url", url]
    server = subprocess.Popen(
        [*command, "--port", str(port), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stack.callback(server.wait, 30)
    stack.callback(server.terminate)
    return f"http://127.0.0.1:{port}"


def _started(base: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{base} did not start"
        time.sleep(0.1)


def _workers(stack: ExitStack, url: str) -> None:
    """Start the workers (forked: separate processes without a second start-up's
    imports) and wait until each holds its locks."""
    fork = multiprocessing.get_context("fork")
    ends = []
    for spec in WORKERS:
        ours, theirs = fork.Pipe()
        target = _jobs if spec.get("jobs") else _work
        worker = fork.Process(target=target, args=(url, spec, theirs, ours), daemon=True)
        worker.start()
        theirs.close()
        stack.callback(worker.join, 30)
        stack.callback(ours.close)
        ends.append(ours)
    for end in ends:
        assert end.poll(60) and end.recv() == "holding"


def _keys(page: Page) -> list[str]:
    """The keys the Locks page lists, as shown."""
    return page.locator("td.key a").all_inner_texts()


def _shot(page: Page, name: str, dialect: str) -> None:
    folder = os.environ.get("TASKGUARD_WEB_SCREENSHOTS")
    if folder and dialect == "postgresql":
        page.screenshot(path=str(Path(folder) / f"web-{name}.png"), full_page=True)


def _phases_and_slots(page: Page) -> list[tuple[str, str, str]]:
    """(key, phase, slots) of each row the Locks page lists, sorted."""
    keys = _keys(page)
    phases = page.locator("td.phase").all_inner_texts()
    slots = page.locator("td.slots").all_inner_texts()
    return sorted(zip(keys, phases, slots, strict=True))


def _release(page: Page, reason: str) -> None:
    """From a key's page: through the confirmation, with a reason."""
    page.get_by_role("link", name="Force-release…").click()
    page.get_by_label("Reason").fill(reason)
    page.get_by_role("button", name="Force-release").click()
    assert page.locator("p.ok").inner_text().startswith("Force-released")


def test_the_page_in_a_browser(
    browser: Browser, db_url: str, request: pytest.FixtureRequest
) -> None:
    dialect = request.node.callspec.params["db_url"]
    with ExitStack() as stack:
        base = _serve(stack, db_url, "--allow-actions")
        read_only = _serve(stack, db_url)
        _workers(stack, db_url)
        guard = TaskGuard(db_url, history=True)  # after the fork: the workers have their own
        stack.callback(guard.dispose)
        for _ in range(2):  # two starts turned away, for the chart
            assert guard.try_acquire("feed:1", 60, task_name="app.import_feed").lease is None
        while guard.get("cleanup:old").held:  # type: ignore[union-attr]
            time.sleep(0.1)  # the dead worker's lease runs out
        _started(base)
        _started(read_only)
        context = browser.new_context(
            http_credentials={"username": USER, "password": PASSWORD},
            viewport={"width": 1200, "height": 700},
        )
        stack.callback(context.close)
        page = context.new_page()
        dialogs: list[str] = []

        def dialog(opened: Dialog) -> None:  # a script ran: a key was not escaped
            dialogs.append(opened.message)
            opened.dismiss()

        page.on("dialog", dialog)

        # Overview: the cards, the chart.
        page.goto(base + "/")
        cards = dict(
            (label.split("(")[0].split(":")[0].strip(), number)
            for number, label in (
                (c.locator("b").inner_text(), c.inner_text().split("\n", 1)[-1])
                for c in page.locator(".card").all()
            )
        )
        # feed:1, feed:2, 2 report slots, 4 hostile, the queued job, the running one
        assert cards["locks held"] == "10", cards
        assert cards["keys at their limit"] == "9", cards
        assert cards["expired rows not yet reaped"] == "1", cards
        assert cards["keys with waiters"] == "0", cards
        assert "oldest hold" in cards and "reaper's last run" in cards
        assert page.locator("svg rect").count() >= 24
        assert "2 conflict(s) in all" in page.inner_text("main")
        _shot(page, "overview", dialect)

        # Locks: the filters, through the form.
        page.get_by_role("link", name="Locks").first.click()
        shown = _keys(page)
        assert {"feed:1", "feed:2", "report:daily"} <= set(shown) and len(shown) == 10
        assert "cleanup:old" not in shown
        # The phase and the slots in use: the queue_and_run job waiting in the queue, the
        # one running (its run adopted its lease), the limit=2 key with two holders.
        found = _phases_and_slots(page)
        assert [r for r in found if r[0].startswith(("job:", "report:"))] == [
            ("job:queued", "queue", "1 of 1"),
            ("job:running", "run", "1 of 1"),
            ("report:daily", "-", "2 of 2"),
            ("report:daily", "-", "2 of 2"),
        ], found
        for phase, keys in (("queue", ["job:queued"]), ("run", ["job:running"])):
            page.get_by_label("Phase").select_option(phase)
            page.get_by_role("button", name="Filter").click()
            assert _keys(page) == keys, phase
        page.get_by_label("Phase").select_option("")
        page.get_by_label("State").select_option("expired")
        page.get_by_role("button", name="Filter").click()
        assert _keys(page) == ["cleanup:old"]
        page.get_by_label("State").select_option("all")
        page.get_by_label("Key prefix").fill("feed:")
        page.get_by_role("button", name="Filter").click()
        assert sorted(_keys(page)) == ["feed:1", "feed:2"]
        page.get_by_label("Key prefix").fill("")
        page.get_by_label("Task").fill("app.report")
        page.get_by_role("button", name="Filter").click()
        assert _keys(page) == ["report:daily", "report:daily"]
        page.goto(base + "/locks?state=all")
        _shot(page, "locks", dialect)

        # A key: its story, its rows; force-release it with a reason.
        page.get_by_role("link", name="feed:1", exact=True).click()
        assert "turned away" in page.inner_text("main")
        _shot(page, "key", dialect)
        page.get_by_role("link", name="Force-release…").click()
        _shot(page, "release", dialect)
        page.go_back()
        _release(page, "worker host died")
        assert not guard.get("feed:1").held  # type: ignore[union-attr]
        story = page.inner_text("pre")
        assert f"ended by {USER}: worker host died" in story, story

        # Hostile keys: shown escaped, each released through the browser.
        page.goto(base + "/locks?task=hostile")
        text = page.inner_text("main")
        assert "\u202e" not in text and "\x1b" not in text and "<i>" in text
        assert page.locator("main i, main script").count() == 0
        links = page.locator("td.key a")
        hrefs = [links.nth(i).get_attribute("href") for i in range(links.count())]
        assert len(hrefs) == len(HOSTILE)
        for href in hrefs:
            page.goto(base + str(href))
            assert "\u202e" not in page.inner_text("main")
            _release(page, "hostile key")
        assert not dialogs
        left = [i.key for i in guard.held() if i.holder.task_name == "<i>app.hostile</i>\u202e"]
        assert left == []
        # A lone surrogate reaches no database: its URL shows a key with no row.
        page.goto(base + "/keys/%ED%A0%80")
        assert "no row" in page.inner_text("main")

        # Refused: no credentials, wrong credentials, no CSRF token, a read-only page.
        release = f"/release?key={quote('feed:2', safe='')}"
        # (headless Chromium would wait for someone to type credentials: asked raw)
        for auth in (None, (USER, "wrong")):
            assert httpx.get(base + release, auth=auth).status_code == 401
            refused = httpx.post(base + release, data={"reason": "r"}, auth=auth)
            assert refused.status_code == 401
        raw = httpx.post(base + release, data={"reason": "r"}, auth=(USER, PASSWORD))
        assert raw.status_code == 403 and "CSRF" in raw.text
        page.goto(read_only + "/keys/feed%3A2")
        assert page.locator("form[method=post]").count() == 0
        assert "Force-release" not in page.inner_text("main")
        page.goto(read_only + "/")
        assert page.get_by_role("button", name="Reap now").count() == 0
        assert guard.get("feed:2").held  # type: ignore[union-attr]
