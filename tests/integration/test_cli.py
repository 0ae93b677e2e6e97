"""The ``taskguard`` command line, run as real subprocesses against real databases
(cli_runner.py): listing and showing locks, errors, masking, untrusted text, and
the database commands. Releasing and reaping are in test_cli_release.py,
``celery -A … taskguard`` in test_cli_celery.py."""

from __future__ import annotations

import json

import psycopg
import pytest
from cli_runner import (  # noqa: F401 - fixtures
    CELERY,
    PASSWORD,
    TASKGUARD,
    base_env,
    env,
    guard,
    lock_url,
    run,
    tg,
    url,
    with_password,
)
from sqlalchemy.engine import make_url

from taskguard import TaskGuard, schema
from taskguard.options import Phase

pytestmark = pytest.mark.postgres


# -- locks / show --------------------------------------------------------------------------


def test_locks_lists_live_leases_as_table_and_json(guard: TaskGuard, env: dict[str, str]) -> None:
    assert tg("locks", env=env).strip() == "no locks held"
    assert tg("locks", "--json", env=env).strip() == "[]"
    a = guard.acquire("invoice:1", 300, task_name="billing.charge", task_id="t-1", pid=4242)
    b = guard.acquire("invoice:2", 300, task_name="billing.charge", hostname="worker-9")
    c = guard.acquire("report:x", 300, task_name="reports.build")
    old = guard.acquire("invoice:old", 0.001, task_name="billing.charge")
    assert a and b and c and old

    rows = json.loads(tg("locks", "--json", env=env))
    assert [r["key"] for r in rows] == ["invoice:1", "invoice:2", "report:x"]
    first = rows[0]
    assert first["owner"] == a.owner and first["token"] == a.token
    assert first["task_name"] == "billing.charge" and first["task_id"] == "t-1"
    assert first["pid"] == 4242 and first["held"] is True
    assert (first["phase"], first["slots"], first["slots_in_use"]) == (None, 1, 1)
    assert 0 < first["expires_in_seconds"] <= 300

    rows = json.loads(tg("locks", "--prefix", "invoice:", "--json", env=env))
    assert [r["key"] for r in rows] == ["invoice:1", "invoice:2"]
    rows = json.loads(tg("locks", "--all", "--json", "--prefix", "invoice:", env=env))
    assert {r["key"]: r["held"] for r in rows} == {
        "invoice:1": True,
        "invoice:2": True,
        "invoice:old": False,
    }

    table = tg("locks", env=env).splitlines()
    assert table[0].split() == ["KEY", "PHASE", "SLOT", "SLOTS", "TOKEN", "TASK", "HOST", "PID",
                                "HELD", "FOR", "EXPIRES", "IN"]  # fmt: skip
    # A plain acquire: no phase; one slot of a limit of 1 in use.
    assert table[1].split()[:7] == ["invoice:1", "-", "0", "1", "of", "1", str(a.token)]
    assert "worker-9" in table[2]
    assert len(table) == 4
    table = tg("locks", "--all", "--prefix", "invoice:", env=env).splitlines()
    assert table[0].split()[-1] == "STATE"
    assert table[3].split()[0] == "invoice:old" and table[3].split()[-1] == "expired"
    assert (
        tg("locks", "--prefix", "nothing:", env=env).strip()
        == "no locks held with prefix 'nothing:'"
    )


def test_locks_lists_held_locks_and_companion_rows_on_request(
    guard: TaskGuard, env: dict[str, str]
) -> None:
    """Issue 27, item 7: finished runs' records crowded the list (51 of 52 rows)."""
    lock = guard.acquire("feed:1", 300, task_name="feeds.import")
    assert lock is not None
    companions = ("feed:1#pending:feeds.import", "feed:1#debounce:feeds.reindex", "feed:0#rate",
                  "taskguard:finished:t-1")  # fmt: skip
    for key in companions:
        assert guard.acquire(key, 300, task_name="feeds.import") is not None
    assert [r["key"] for r in json.loads(tg("locks", "--json", env=env))] == ["feed:1"]
    assert [line.split()[0] for line in tg("locks", env=env).splitlines()] == ["KEY", "feed:1"]
    every = [r["key"] for r in json.loads(tg("locks", "--all", "--json", env=env))]
    assert every == ["feed:0#rate", "feed:1", "feed:1#debounce:feeds.reindex",
                     "feed:1#pending:feeds.import", "taskguard:finished:t-1"]  # fmt: skip
    # The API's limit counts locks, however many companion rows sort before them.
    for i in range(5):
        assert guard.acquire(f"a:{i}#pending", 300) is not None
    assert [i.key for i in guard.held(limit=1)] == ["feed:1"]
    assert len(guard.held(limit=3, companions=True)) == 3
    # `show` names a key's companions; --all lists their rows too.
    assert [r["key"] for r in json.loads(tg("show", "feed:1", "--json", env=env))] == ["feed:1"]
    shown = json.loads(tg("show", "feed:1", "--all", "--json", env=env))
    assert [r["key"] for r in shown] == [
        "feed:1", "feed:1#debounce:feeds.reindex", "feed:1#pending:feeds.import"
    ]  # fmt: skip


def test_show_prints_who_holds_a_key(guard: TaskGuard, env: dict[str, str]) -> None:
    lease = guard.acquire("invoice:42", 300, task_name="billing.charge", task_id="abc", pid=77)
    assert lease is not None
    out = tg("show", "invoice:42", env=env)
    fields = dict(line.split(":", 1) for line in out.splitlines() if line.strip())
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    assert fields["state"] == "held"
    assert fields["owner"] == lease.owner
    assert fields["token"] == str(lease.token)
    assert fields["task"] == "billing.charge" and fields["task id"] == "abc"
    assert fields["pid"] == "77" and fields["host"] == guard.hostname
    for name in ("acquired", "expires", "held for", "expires in"):
        assert fields[name]
    [row] = json.loads(tg("show", "invoice:42", "--json", env=env))
    assert row["owner"] == lease.owner

    proc = run([*TASKGUARD, "show", "invoice:nope"], env, code=1)
    assert "no lock row for 'invoice:nope'" in proc.stderr

    guard.release(lease)
    out = tg("show", "invoice:42", env=env)
    # Without history a release and an expiry leave the same row.
    assert "state:      free, ended" in out and "released or expired; row not yet reaped" in out


def test_locks_and_show_tell_the_phase_and_the_slots_in_use(
    guard: TaskGuard, env: dict[str, str]
) -> None:
    """Issue 44: the phase a guarded task's lease is in, and its key's slots in use."""
    assert guard.try_acquire("job:q", 300, task_name="app.job", phase=Phase.QUEUE).lease
    for _ in range(2):
        assert guard.try_acquire("batch:y", 300, limit=3, phase=Phase.RUN).lease
    table = tg("locks", env=env).splitlines()
    # KEY PHASE SLOT SLOTS: the slot number left out (a limit's slot is picked at random)
    cells = sorted([*c[:2], *c[3:6]] for c in (line.split() for line in table[1:]))
    assert cells == [["batch:y", "run", "2", "of", "3"]] * 2 + [["job:q", "queue", "1", "of", "1"]]
    rows = json.loads(tg("locks", "--json", env=env))
    assert {(r["key"], r["phase"], r["slots"], r["slots_in_use"]) for r in rows} == {
        ("batch:y", "run", 3, 2),
        ("job:q", "queue", 1, 1),
    }
    out = tg("show", "batch:y", env=env)
    assert out.count("slots:      2 of 3") == 2 and out.count("phase:      run") == 2, out


def test_show_says_how_a_lease_ended_as_explain_does(url: str, env: dict[str, str]) -> None:
    """Issue 41, defect 8c: `show` said "expired 18.0s ago (row not yet reaped)" for a
    lease the worker's main process released, where `explain` says released."""
    guard = TaskGuard(url, history=True)
    try:
        lease = guard.acquire("invoice:killed", 300, task_name="billing.charge")
        assert lease is not None
        why = "by the worker's main process: worker process lost (signal 9)"
        assert guard.release(lease, reason=why)
    finally:
        guard.dispose()
    state = dict(line.split(":", 1) for line in tg("show", "invoice:killed", env=env).splitlines())
    assert state["state"].strip().startswith("free, released "), state
    assert state["state"].strip().endswith(f"ago ({why})"), state
    assert f"released       owner {lease.owner}" in tg("explain", "invoice:killed", env=env)


def test_show_and_explain_see_a_key_whose_only_rows_are_companions(
    guard: TaskGuard, env: dict[str, str]
) -> None:
    """Issue 33, defect 4: after one debounced (or coalesced) submission the key has
    only its companion rows; `show` said "no lock row" (exit 1), `explain` "nothing
    recorded"."""
    for key in ("feed:x#debounce:feeds.reindex", "feed:x#pending:feeds.import"):
        assert guard.acquire(key, 300, task_name="feeds.import", task_id="p-1") is not None
    out = tg("show", "feed:x", env=env)
    assert out.splitlines()[0] == "no lock row for 'feed:x' (free); its companion rows:", out
    assert "debounce batch: first submission" in out
    assert "pending run: task p-1 (feeds.import)" in out and "state:" not in out
    assert len(out.splitlines()) == 3, out
    every = tg("show", "feed:x", "--all", env=env)
    assert every.count("state:") == 2 and "key:        feed:x#pending:feeds.import" in every
    assert json.loads(tg("show", "feed:x", "--json", env=env)) == []
    rows = json.loads(tg("show", "feed:x", "--all", "--json", env=env))
    assert [r["key"] for r in rows] == [
        "feed:x#debounce:feeds.reindex",
        "feed:x#pending:feeds.import",
    ]
    story = tg("explain", "feed:x", env=env)
    assert "now: free (no row)" in story and "debounce batch: first submission" in story
    assert "pending run: task p-1" in story
    assert len(json.loads(tg("explain", "feed:x", "--json", env=env))["companions"]) == 2
    # A key with nothing at all is still "not found".
    assert "no lock row for 'feed:y'" in run([*TASKGUARD, "show", "feed:y"], env, code=1).stderr
    assert "nothing recorded" in run([*TASKGUARD, "explain", "feed:y"], env, code=1).stderr


def test_locks_all_says_what_each_companion_row_is(guard: TaskGuard, env: dict[str, str]) -> None:
    """Issue 33: finished runs' records were listed as STATE "held"."""
    for key in ("feed:1", "feed:1#pending:feeds.import", "feed:1#debounce:feeds.reindex",
                "feed:1#rate", "taskguard:finished:t-1"):  # fmt: skip
        assert guard.acquire(key, 300) is not None
    expired = guard.acquire("feed:2", 0.05)
    assert expired is not None and guard.release(expired)
    table = tg("locks", "--all", env=env).splitlines()
    states = {line.split()[0]: line.split()[-1] for line in table[1:]}
    assert states == {
        "feed:1": "held",
        "feed:1#debounce:feeds.reindex": "debounce",
        "feed:1#pending:feeds.import": "pending",
        "feed:1#rate": "rate",
        "feed:2": "expired",
        "taskguard:finished:t-1": "finished",
    }, table
    details = tg("show", "feed:1", "--all", env=env)
    assert "state:      held (pending run)" in details


# -- errors and masking ----------------------------------------------------------------------


def test_errors_are_one_masked_line(pg_url: str, empty_pg_url: str) -> None:
    env = base_env()
    proc = run([*TASKGUARD, "locks"], env, code=2)
    assert "no database URL" in proc.stderr
    refused = f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:1/nowhere"
    proc = run([*TASKGUARD, "locks", "--database-url", refused], env, code=2)
    assert "postgres:***@127.0.0.1:1/nowhere unavailable" in proc.stderr
    proc = run(
        [*TASKGUARD, "show", "k", "--database-url", with_password(empty_pg_url)], env, code=2
    )
    assert "tables are missing" in proc.stderr and "taskguard db upgrade" in proc.stderr
    proc = run([*TASKGUARD, "locks", "--database-url", f"nosuchdb://u:{PASSWORD}@h/d"], env, code=2)
    assert "u:***@h/d" in proc.stderr
    run([*TASKGUARD, "locks", "--no-such-option"], env, code=2)
    run([*TASKGUARD, "show"], env, code=2)


def test_only_the_urls_password_is_masked(pg_url: str) -> None:
    """Issue 33, defect 5: every occurrence of the password's text was masked:
    password `postgres` in `postgres:postgres@` gave `***ql+psycopg://***:***@`,
    password `x` gave `role "nobody" does not e***ist`, `127` masked the host."""
    env = base_env()
    for password in ("postgres", "127"):
        refused = f"postgresql+psycopg://postgres:{password}@127.0.0.1:1/nowhere"
        proc = run([*TASKGUARD, "locks", "--database-url", refused], env, code=2)
        assert "postgresql+psycopg://postgres:***@127.0.0.1:1/nowhere unavailable" in proc.stderr
    nobody = make_url(pg_url).set(username="nobody", password="x")
    proc = run([*TASKGUARD, "locks", "--database-url", nobody.render_as_string(False)], env, code=2)
    assert 'role "nobody" does not exist' in proc.stderr, proc.stderr
    assert "nobody:***@" in proc.stderr and ":x@" not in proc.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["lock"], "no command 'lock'; did you mean `taskguard locks`?"),
        (["db", "upgrad"], "no command 'upgrad'; did you mean `taskguard db upgrade`?"),
        (["frobnicate"], "no command 'frobnicate'; the commands are check, db, demo, explain"),
        (["explain", "k", "--limit", "0"], "0 is not in the range 1<=x<=10000"),
        (["--bogus"], "--bogus"),
        (["db", "current", "--bogus"], "--bogus"),
    ],
)
def test_usage_errors_are_one_line(argv: list[str], said: str) -> None:
    """Issue 33: these printed Click's usage block; every CLI error is one line
    (`run` checks that), naming the problem and the fix."""
    proc = run([*TASKGUARD, *argv], base_env(), code=2)
    assert said in proc.stderr, proc.stderr
    if not said.startswith("no command"):
        assert "--help` for usage" in proc.stderr, proc.stderr


def test_db_commands_mask_the_password(empty_pg_url: str) -> None:
    env = {**base_env(), "TASKGUARD_DATABASE_URL": with_password(empty_pg_url)}
    out = tg("db", "upgrade", env=env)
    assert "postgres:***@" in out
    assert out.strip().endswith(f"taskguard schema base -> {schema.head()}"), out
    # Run again it says that nothing changed (issue 27: it printed the same line).
    again = tg("db", "upgrade", env=env)
    assert again.strip().endswith(f"already at {schema.head()}; nothing to do"), again
    assert "up to date" in tg("db", "current", env=env)


def test_sqlite_database(sqlite_url: str) -> None:
    guard = TaskGuard(sqlite_url)
    try:
        guard.acquire("lite", 300, task_name="t")
    finally:
        guard.dispose()
    env = {**base_env(), "TASKGUARD_DATABASE_URL": sqlite_url}
    assert [r["key"] for r in json.loads(tg("locks", "--json", env=env))] == ["lite"]
    assert "state:      held" in tg("show", "lite", env=env)


# -- untrusted text in human-readable output (issue 16, item 5) ------------------------------

FORGED_KEY = "evil\nforged:row  0  1  billing.charge  worker-1  1  1.0s  4m59s"
ESCAPES = "\x1b[2J\x1b]0;pwned\x07"


def _inert(text: str) -> None:
    """Nothing a terminal would act on: no control characters but line ends."""
    bad = [c for c in text if not c.isprintable() and c != "\n"]
    assert bad == [], f"raw control characters reach the terminal: {bad!r}\n{text!r}"


def test_human_output_escapes_control_characters(url: str, env: dict[str, str]) -> None:
    guard = TaskGuard(url, history=True, hostname=f"host\r{ESCAPES}")
    try:
        lease = guard.acquire(FORGED_KEY, 300, task_name=f"task{ESCAPES}", task_id="id\n2")
        assert lease is not None
        guard.acquire(FORGED_KEY, 300, task_name="other\x1b[31m")  # a recorded conflict
    finally:
        guard.dispose()

    out = tg("locks", env=env)
    _inert(out)
    lines = out.splitlines()
    assert len(lines) == 2, out  # the header and ONE row: the newline forged nothing
    assert lines[1].startswith("evil\\nforged:row  0  1")
    assert "task\\x1b[2J\\x1b]0;pwned\\x07" in lines[1]
    assert "host\\r\\x1b[2J" in lines[1]

    out = tg("show", FORGED_KEY, env=env)
    _inert(out)
    assert len(out.splitlines()) == 15, out  # one line per field
    assert "key:        evil\\nforged:row" in out and "task id:    id\\n2" in out

    out = tg("explain", FORGED_KEY, env=env)
    _inert(out)
    assert "turned away" in out and "other\\x1b[31m" in out

    proc = run([*TASKGUARD, "release", FORGED_KEY, "--owner", "nobody"], env, code=1)
    _inert(proc.stderr)
    assert "task\\x1b[2J" in proc.stderr

    # --json is unchanged: the exact values, escaped the JSON way.
    [row] = json.loads(tg("locks", "--json", env=env))
    assert row["key"] == FORGED_KEY and row["task_name"] == f"task{ESCAPES}"
    assert row["hostname"] == f"host\r{ESCAPES}" and row["task_id"] == "id\n2"
    [row] = json.loads(tg("show", FORGED_KEY, "--json", env=env))
    assert row["key"] == FORGED_KEY
    events = json.loads(tg("explain", FORGED_KEY, "--json", env=env))["events"]
    assert {e["task_name"] for e in events} >= {f"task{ESCAPES}", "other\x1b[31m"}


# -- the front door's small cuts (issue 16, item 7) ------------------------------------------


def test_show_json_for_a_missing_key_prints_a_json_error(env: dict[str, str]) -> None:
    proc = run([*TASKGUARD, "show", "invoice:nope", "--json"], env, code=1)
    error = json.loads(proc.stdout)
    assert error["key"] == "invoice:nope" and error["exit_code"] == 1
    assert "no lock row for 'invoice:nope'" in error["error"]
    assert "no lock row for 'invoice:nope'" in proc.stderr  # the usual line, for people
    proc = run([*CELERY, "show", "celery:none", "--json"], {**base_env(), "OPS_APP_DATABASE_URL": env["TASKGUARD_DATABASE_URL"]}, code=1)  # fmt: skip
    assert json.loads(proc.stdout)["key"] == "celery:none"


def _switch_to_application_alembic(url: str, *, drop: bool = True) -> None:
    """docs/alembic.md, "Switching from way 1 to way 2": taskguard's head recorded in
    the application's alembic_version, taskguard's own version table dropped (unless
    ``drop=False``: the switch left half done)."""
    from taskguard import schema

    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES ('5f2c1a9d0e11'), (%s)", [schema.head()])
        if drop:
            conn.execute("DROP TABLE taskguard_alembic_version")


def test_db_current_names_the_stale_version_table_when_both_exist(empty_pg_url: str) -> None:
    """Issue 41, defect 8f: with taskguard_alembic_version and the application's
    alembic_version both recording taskguard's revision, `db current` said "up to date"."""
    env = {**base_env(), "TASKGUARD_DATABASE_URL": with_password(empty_pg_url)}
    tg("db", "upgrade", env=env)
    _switch_to_application_alembic(empty_pg_url, drop=False)
    out = tg("db", "current", env=env)
    head = schema.head()
    assert out.startswith(f"{head} (up to date, in taskguard_alembic_version, the table"), out
    assert f"alembic_version also records {head}, ignored while" in out and "(stale)" in out
    assert "DROP TABLE taskguard_alembic_version" in out, out
    assert f"DELETE FROM alembic_version WHERE version_num IN ('{head}')" in out, out


def test_db_commands_after_switching_to_the_applications_alembic(empty_pg_url: str) -> None:
    env = {**base_env(), "TASKGUARD_DATABASE_URL": with_password(empty_pg_url)}
    tg("db", "upgrade", env=env)
    _switch_to_application_alembic(empty_pg_url)

    out = tg("db", "current", env=env)
    assert not out.startswith("base"), out
    assert "managed by your application's Alembic" in out and "alembic upgrade heads" in out
    # The start-up check reads the same place (issue 27, item 1).
    assert ": ok (schema at " in tg("check", env=env)
    proc = run([*TASKGUARD, "db", "upgrade"], env, code=2)
    assert "managed by your application's Alembic" in proc.stderr
    assert "alembic upgrade heads" in proc.stderr and "already exists" not in proc.stderr
    run([*TASKGUARD, "db", "downgrade", "--yes"], env, code=2)
    # Nothing was touched: the locks still work.
    guard = TaskGuard(empty_pg_url)
    try:
        assert guard.acquire("still:works", 60) is not None
    finally:
        guard.dispose()
