"""taskguard's migrations inside an application's existing database."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from datetime import datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import column, create_engine, insert, inspect, select, table, text

from taskguard import TaskGuard, metadata, schema
from taskguard.options import Phase

REPO = Path(__file__).resolve().parents[2]


def _app_tables(url: str) -> None:
    """An application with its own tables and its own Alembic history."""
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE feeds (id INTEGER PRIMARY KEY, url VARCHAR(200))"))
        conn.execute(text("INSERT INTO feeds VALUES (1, 'https://example.org/rss')"))
        conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)"))
        conn.execute(text("INSERT INTO alembic_version VALUES ('app_0042')"))
    engine.dispose()


def _app_state(url: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        versions = [tuple(r) for r in conn.execute(text("SELECT * FROM alembic_version"))]
        feeds = [tuple(r) for r in conn.execute(text("SELECT * FROM feeds"))]
    engine.dispose()
    return versions, feeds


def _objects(url: str) -> set[str]:
    engine = create_engine(url)
    insp = inspect(engine)
    names = set(insp.get_table_names()) | set(insp.get_view_names())
    if engine.dialect.name in ("postgresql", "mysql"):
        names |= set(insp.get_sequence_names())
    engine.dispose()
    return names


@pytest.fixture(params=["postgresql", "sqlite", "mariadb"])
def app_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        url = str(request.getfixturevalue("empty_pg_url"))
    elif request.param == "mariadb":
        url = str(request.getfixturevalue("empty_maria_url"))
    else:
        url = f"sqlite:///{tmp_path / 'app.sqlite'}"
    _app_tables(url)
    return url


def test_upgrade_downgrade_upgrade_leaves_the_app_alone(app_db: str) -> None:
    before = _app_state(app_db)
    schema.upgrade(app_db)
    schema.upgrade(app_db)  # idempotent
    assert schema.current(app_db) == [schema.head()]
    assert {"task_locks", "task_locks_held", "taskguard_alembic_version"} <= _objects(app_db)
    guard = TaskGuard(app_db)
    assert guard.acquire("k", 30) is not None
    guard.dispose()

    schema.downgrade(app_db)
    assert schema.current(app_db) == []
    left = _objects(app_db)
    assert "task_locks" not in left and "task_locks_held" not in left
    assert {"feeds", "alembic_version"} <= left

    schema.upgrade(app_db)
    assert schema.current(app_db) == [schema.head()]
    assert _app_state(app_db) == before  # app's alembic_version row and data untouched


def test_upgrading_keeps_live_leases_and_reads_them_as_not_recorded(app_db: str) -> None:
    """tg0003 (phase, slots) on a database whose rows an older version wrote: the rows
    stay live and read as "not recorded"; new grants record both; downgrading keeps
    the rows."""
    schema.upgrade(app_db, "tg0002")
    engine = create_engine(app_db)
    cols = ("key", "slot", "owner", "token", "acquired_at", "expires_at", "task_name")
    locks = table("task_locks", *(column(c) for c in cols))  # quoted as each database needs
    with engine.begin() as conn:  # a live lease as the version before wrote it
        old = ("old", 0, "o1", 1, datetime(2026, 1, 1), datetime(2999, 1, 1), "t.old")
        conn.execute(insert(locks).values(dict(zip(cols, old, strict=True))))
    schema.upgrade(app_db)
    guard = TaskGuard(app_db)
    try:
        (old,) = guard.get_all("old")
        assert (old.held, old.phase, old.slots, old.task_name) == (True, None, None, "t.old")
        assert guard.try_acquire("new", 30, limit=2, phase=Phase.RUN).lease is not None
        assert [(i.phase, i.slots) for i in guard.get_all("new")] == [(Phase.RUN, 2)]
    finally:
        guard.dispose()
    view = "SELECT phase, slots FROM task_locks_held"
    with engine.connect() as conn:  # the view shows them too
        assert {tuple(r) for r in conn.execute(text(view))} == {("run", 2), (None, None)}
    schema.downgrade(app_db, "tg0002")
    with engine.connect() as conn:
        keys = sorted(conn.execute(select(locks.c.key)).scalars())
        columns = {c["name"] for c in inspect(conn).get_columns("task_locks")}
        held = sorted(conn.execute(text("SELECT owner FROM task_locks_held")).scalars())
    engine.dispose()
    assert keys == ["new", "old"] and not {"phase", "slots"} & columns
    assert len(held) == 2  # the view as tg0002 had it


def test_models_and_migrations_never_drift(db_url: str) -> None:
    engine = create_engine(db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={
                "include_object": schema.include_taskguard_object,
                "compare_type": True,
                "compare_server_default": True,
            },
        )
        diff = compare_metadata(ctx, metadata)
    engine.dispose()
    assert diff == []


def test_offline_sql_names_every_object() -> None:
    ddl = schema.sql("postgresql+psycopg://u:secret@h/db")
    for name in (
        "CREATE TABLE task_locks",
        "CREATE SEQUENCE task_locks_token_seq",
        "CREATE VIEW task_locks_held",
        "taskguard_alembic_version",
    ):
        assert name in ddl
    assert "alembic_version (" not in ddl.replace("taskguard_alembic_version (", "")


def test_the_root_revision_carries_the_branch_label() -> None:
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(schema.alembic_config())
    base = scripts.get_revision(scripts.get_bases()[0])
    assert base is not None and "taskguard" in base.branch_labels


def test_installed_wheel_migrates_an_existing_database(tmp_path: Path, empty_pg_url: str) -> None:
    """Build the wheel, install it into a fresh venv, and run its console script."""
    _app_tables(empty_pg_url)
    before = _app_state(empty_pg_url)
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(REPO),
        ],
        check=True,
    )
    wheel = next(dist.glob("taskguard_sql-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "taskguard/migrations/env.py" in names
    assert any(n.startswith("taskguard/migrations/versions/0001_") for n in names)
    assert "taskguard/py.typed" in names

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Dependencies come from this test's environment (a plain path entry, so its .pth
    # files - e.g. an editable taskguard - are not processed); taskguard itself only
    # from the wheel, installed by this environment's pip into the new venv.
    Path(purelib, "deps.pth").write_text("\n".join(p for p in sys.path if p.endswith("-packages")))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            # A source tree on PYTHONPATH (its egg-info) otherwise reads as "already
            # installed with the same version" and the wheel is skipped.
            "--force-reinstall",
            str(wheel),
        ],
        check=True,
        cwd=tmp_path,
    )
    where = subprocess.run(
        [str(py), "-I", "-c", "import taskguard; print(taskguard.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout.strip()
    assert where.startswith(str(env_dir)), where  # not the source tree, not the dev install
    for _ in range(2):  # the second run finds it done and changes nothing
        run = subprocess.run(
            [str(env_dir / "bin" / "taskguard"), "db", "upgrade", "--database-url", empty_pg_url],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert run.returncode == 0, run.stderr
        assert schema.head() in run.stdout
        assert {"task_locks", "task_locks_held"} <= _objects(empty_pg_url)
        assert _app_state(empty_pg_url) == before


def test_mariadb_tables_compare_keys_byte_exactly(maria_url: str) -> None:
    engine = create_engine(maria_url)
    with engine.connect() as conn:
        collations = conn.execute(
            text(
                "SELECT TABLE_NAME, TABLE_COLLATION FROM information_schema.TABLES"
                " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_TYPE = 'BASE TABLE'"
                " AND TABLE_NAME LIKE 'task_lock%'"
            )
        ).all()
        kinds = dict(
            conn.execute(
                text(
                    "SELECT TABLE_NAME, TABLE_TYPE FROM information_schema.TABLES"
                    " WHERE TABLE_SCHEMA = DATABASE()"
                )
            ).all()
        )
    engine.dispose()
    assert dict(collations) == {
        "task_locks": "utf8mb4_nopad_bin",
        "task_lock_events": "utf8mb4_nopad_bin",
    }
    assert kinds["task_locks_token_seq"] == "SEQUENCE"
    assert kinds["task_locks_held"] == "VIEW"


def test_refused_database_one_line_exit_2_nothing_created(empty_maria_url: str) -> None:
    """A server taskguard does not support (here: MariaDB below a raised minimum, as
    no MySQL server is at hand) is refused before Alembic creates anything, even
    its version table."""
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, taskguard.dialects.mariadb_server as s; s.MARIADB_MIN = (99, 0); "
            "from taskguard.cli import main; main(sys.argv[1:])",
            *("db", "upgrade", "--database-url", empty_maria_url),
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs MariaDB 99.0 or newer; this server is MariaDB" in lines[0], (
        run.stderr
    )
    assert _objects(empty_maria_url) == set()
