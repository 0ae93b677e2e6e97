"""The ``taskguard`` command line and ``celery -A … taskguard``, run as real
subprocesses against real databases. Every invocation goes through ``run()``,
which also checks that the database password never appears in any output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import MySQLdb
import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from taskguard import TaskGuard

pytestmark = pytest.mark.postgres

TESTS_DIR = Path(__file__).resolve().parents[1]
PASSWORD = "s3cr3t-Pa55"  # PostgreSQL trust auth ignores it; it must never be printed

_script = shutil.which("taskguard", path=str(Path(sys.executable).parent)) or shutil.which(
    "taskguard"
)
TASKGUARD = (
    [_script] if _script else [sys.executable, "-c", "from taskguard.cli import main; main()"]
)
CELERY = [sys.executable, "-m", "celery", "-A", "ops_app", "taskguard"]


def with_password(url: str) -> str:
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def run(
    argv: list[str], env: dict[str, str], input: str | None = None, code: int = 0
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv,
        env=env,
        input=input if input is not None else "",
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TESTS_DIR,
        check=False,
    )
    both = proc.stdout + proc.stderr
    assert PASSWORD not in both, both
    assert proc.returncode == code, f"exit {proc.returncode}, wanted {code}\n{both}"
    if code != 0:
        # The error is one line, prefixed, on stderr (after a confirmation prompt, if any).
        lines = proc.stderr.splitlines()
        assert proc.stderr.endswith("\n"), proc.stderr
        assert lines[-1].startswith("taskguard: "), proc.stderr
        # (click < 8.2 writes the prompt's last space to stdout, hence the rstrip)
        assert len(lines) == 1 or (len(lines) == 2 and lines[0].rstrip().endswith("[y/N]:")), (
            proc.stderr
        )
    return proc


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKGUARD_", "OPS_APP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(params=["postgresql", "mariadb"])
def lock_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test's database, as a role that has a password (it must never be printed)."""
    if request.param == "postgresql":
        yield str(request.getfixturevalue("pg_url"))
        return
    plain = make_url(str(request.getfixturevalue("maria_url")))
    user = f"tg_cli_{plain.database}"[:32]
    admin = MySQLdb.connect(host=plain.host, port=plain.port, user="root", autocommit=True)
    cur = admin.cursor()
    cur.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{PASSWORD}'")
    cur.execute(f"GRANT ALL ON `{plain.database}`.* TO '{user}'@'%'")
    yield plain.set(username=user).render_as_string(hide_password=False)
    cur.execute(f"DROP USER '{user}'@'%'")
    admin.close()


@pytest.fixture
def url(lock_url: str) -> str:
    return with_password(lock_url)


@pytest.fixture
def env(url: str) -> dict[str, str]:
    return {**base_env(), "TASKGUARD_DATABASE_URL": url}


@pytest.fixture
def guard(url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(url)
    yield g
    g.dispose()


def tg(*args: str, env: dict[str, str], input: str | None = None, code: int = 0) -> str:
    return run([*TASKGUARD, *args], env, input, code).stdout


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
    assert table[0].split() == ["KEY", "SLOT", "TOKEN", "TASK", "HOST", "PID", "HELD", "FOR",
                                "EXPIRES", "IN"]  # fmt: skip
    assert table[1].split()[:4] == ["invoice:1", "0", str(a.token), "billing.charge"]
    assert "worker-9" in table[2]
    assert len(table) == 4
    table = tg("locks", "--all", "--prefix", "invoice:", env=env).splitlines()
    assert table[0].split()[-1] == "STATE"
    assert table[3].split()[0] == "invoice:old" and table[3].split()[-1] == "expired"
    assert (
        tg("locks", "--prefix", "nothing:", env=env).strip()
        == "no locks held with prefix 'nothing:'"
    )


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
    assert "state:      expired" in out and "not yet reaped" in out


# -- release -------------------------------------------------------------------------------


def test_release_by_owner(guard: TaskGuard, env: dict[str, str]) -> None:
    lease = guard.acquire("job:1", 300)
    assert lease is not None
    proc = run([*TASKGUARD, "release", "job:1", "--owner", "someone-else"], env, code=1)
    assert "not held by owner someone-else" in proc.stderr and lease.owner in proc.stderr
    assert guard.is_held_by(lease)
    assert "released 'job:1'" in tg("release", "job:1", "--owner", lease.owner, env=env)
    assert not guard.is_held_by(lease)
    run([*TASKGUARD, "release", "job:1", "--owner", lease.owner], env, code=1)
    run([*TASKGUARD, "release", "job:1"], env, code=2)
    run([*TASKGUARD, "release", "job:1", "--owner", lease.owner, "--force"], env, code=2)


def test_force_release_asks_unless_yes(guard: TaskGuard, env: dict[str, str]) -> None:
    lease = guard.acquire("job:2", 300, task_name="stuck.task")
    assert lease is not None
    # No terminal, no answer: nothing happens, exit 2.
    proc = run([*TASKGUARD, "release", "job:2", "--force"], env, code=2)
    assert "pass --yes" in proc.stderr
    assert guard.is_held_by(lease)
    # Declined.
    run([*TASKGUARD, "release", "job:2", "--force"], env, input="n\n", code=1)
    assert guard.is_held_by(lease)
    # Confirmed interactively.
    assert "force-released 'job:2'" in tg("release", "job:2", "--force", input="y\n", env=env)
    assert not guard.is_held_by(lease)
    assert not guard.renew(lease)  # the old holder finds out at its next renewal
    # --yes skips the question.
    lease = guard.acquire("job:2", 300)
    assert lease is not None
    assert "force-released" in tg("release", "job:2", "--force", "--yes", env=env)
    assert not guard.is_held_by(lease)
    proc = run([*TASKGUARD, "release", "job:2", "--force", "--yes"], env, code=1)
    assert "'job:2' is not held" in proc.stderr


# -- reap ----------------------------------------------------------------------------------


_OLD_ROWS = {
    "postgresql": "INSERT INTO task_locks (key, slot, owner, token, acquired_at, expires_at) "
    "SELECT 'old:' || g, 0, md5(g::text), nextval('task_locks_token_seq'), "
    "now() - interval '2 hours', now() - interval '1 hour' "
    "FROM generate_series(1, 2500) g",
    "mysql": "INSERT INTO task_locks (`key`, slot, owner, token, acquired_at, expires_at) "
    "SELECT CONCAT('old:', seq), 0, md5(seq), NEXT VALUE FOR task_locks_token_seq, "
    "UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR "
    "FROM seq_1_to_2500",
}


def test_reap_with_progress(url: str, guard: TaskGuard, env: dict[str, str]) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(_OLD_ROWS[engine.dialect.name])
    engine.dispose()
    live = guard.acquire("live", 300)
    assert live is not None
    proc = run([*TASKGUARD, "reap", "--batch-size", "500", "--grace", "60"], env)
    assert proc.stdout.startswith(
        f"removed 2500 expired lock row(s) from {make_url(url).drivername}://"
    )
    assert ":***@" in proc.stdout
    assert "reap: " in proc.stderr and "removed so far" in proc.stderr
    assert guard.is_held_by(live)
    proc = run([*TASKGUARD, "reap"], env)
    assert proc.stdout.startswith("removed 0 ")
    assert proc.stderr == ""
    proc = run([*TASKGUARD, "reap", "--batch-size", "0"], env, code=2)
    assert "--batch-size" in proc.stderr


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


def test_db_commands_mask_the_password(empty_pg_url: str) -> None:
    env = {**base_env(), "TASKGUARD_DATABASE_URL": with_password(empty_pg_url)}
    out = tg("db", "upgrade", env=env)
    assert "postgres:***@" in out
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


# -- celery -A proj taskguard ------------------------------------------------------------------


def test_celery_taskguard_commands_use_the_app_configuration(guard: TaskGuard, url: str) -> None:
    env = {**base_env(), "OPS_APP_DATABASE_URL": url}
    lease = guard.acquire("celery:1", 300, task_name="proj.task")
    assert lease is not None

    rows = json.loads(run([*CELERY, "locks", "--json"], env).stdout)
    assert [(r["key"], r["owner"]) for r in rows] == [("celery:1", lease.owner)]
    assert "task:       proj.task" in run([*CELERY, "show", "celery:1"], env).stdout
    run([*CELERY, "show", "celery:none"], env, code=1)
    assert "up to date" in run([*CELERY, "db", "current"], env).stdout
    out = run([*CELERY, "reap", "--grace", "0"], env).stdout
    assert out.startswith("removed 0 ") and ":***@" in out
    assert "released" in run([*CELERY, "release", "celery:1", "--owner", lease.owner], env).stdout
    assert not guard.is_held_by(lease)
    help_text = run([*CELERY, "--help"], env).stdout
    for command in ("locks", "show", "release", "reap", "db"):
        assert command in help_text


def test_celery_taskguard_without_a_configured_url(pg_url: str) -> None:
    proc = run([*CELERY, "locks"], base_env(), code=2)
    assert "taskguard_database_url" in proc.stderr
    # An explicit --database-url still works.
    out = run([*CELERY, "locks", "--json", "--database-url", with_password(pg_url)], base_env())
    assert json.loads(out.stdout) == []


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
    assert len(out.splitlines()) == 13, out  # one line per field
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


def test_celery_taskguard_dash_h_is_help(url: str) -> None:
    env = {**base_env(), "OPS_APP_DATABASE_URL": url}
    assert run([*CELERY, "-h"], env).stdout == run([*CELERY, "--help"], env).stdout
    assert "--database-url" in run([*CELERY, "locks", "-h"], env).stdout


def _switch_to_application_alembic(url: str) -> None:
    """docs/alembic.md, "Switching from way 1 to way 2": taskguard's head recorded in
    the application's alembic_version, taskguard's own version table dropped."""
    from taskguard import schema

    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES ('5f2c1a9d0e11'), (%s)", [schema.head()])
        conn.execute("DROP TABLE taskguard_alembic_version")


def test_db_commands_after_switching_to_the_applications_alembic(empty_pg_url: str) -> None:
    env = {**base_env(), "TASKGUARD_DATABASE_URL": with_password(empty_pg_url)}
    tg("db", "upgrade", env=env)
    _switch_to_application_alembic(empty_pg_url)

    out = tg("db", "current", env=env)
    assert not out.startswith("base"), out
    assert "managed by your application's Alembic" in out and "alembic upgrade heads" in out
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


# -- one guard factory (issue 12) ------------------------------------------------------------


def test_cli_guards_honour_every_setting(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under ``celery -A proj taskguard`` every command's guard carries the app's
    taskguard_* settings (durable, history, retention, engine options)."""
    from celery import Celery

    from taskguard.cli.celery import taskguard_command

    built: list[TaskGuard] = []
    original = TaskGuard.__init__

    def spy(self: TaskGuard, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        built.append(self)

    monkeypatch.setattr(TaskGuard, "__init__", spy)
    app = Celery("settings_app", set_as_current=False)
    app.conf.update(
        taskguard_database_url=pg_url,
        taskguard_durable=False,
        taskguard_history=True,
        taskguard_history_retention=3600.0,
        taskguard_engine_options={"pool_size": 2},
    )

    class Root:  # what celery's CLIContext carries for its subcommands
        pass

    root = Root()
    root.app = app  # type: ignore[attr-defined]
    for argv in (["locks"], ["show", "k"], ["explain", "k"], ["reap"]):
        built.clear()
        with pytest.raises(SystemExit):
            taskguard_command.main(args=argv, prog_name="celery taskguard", obj=root)
        assert built, argv
        guard = built[-1]
        assert (guard.durable, guard.history, guard.history_retention) == (False, True, 3600.0), (
            argv
        )
        assert guard.engine.pool.size() == 2, argv  # type: ignore[attr-defined]
    capsys.readouterr()
