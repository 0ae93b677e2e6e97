"""Everything taskguard's migrations create in a database, as comparable data:
tables with their columns (type, nullability, default), indexes, constraints,
sequences, views, triggers and table options."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, text

from taskguard.schema import TASKGUARD_OBJECTS

_PG = {
    "columns": """
        SELECT table_name, column_name, data_type, character_maximum_length,
               is_nullable, column_default, ordinal_position
        FROM information_schema.columns
        WHERE table_schema = 'public' AND table_name = ANY(:names)""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'public' AND tablename = ANY(:names)""",
    "constraints": """
        SELECT rel.relname, con.conname, pg_get_constraintdef(con.oid)
        FROM pg_constraint con JOIN pg_class rel ON rel.oid = con.conrelid
        WHERE rel.relname = ANY(:names)""",
    "sequences": """
        SELECT sequence_name, data_type, start_value, increment, maximum_value
        FROM information_schema.sequences WHERE sequence_schema = 'public'
          AND sequence_name = ANY(:names)""",
    "views": """
        SELECT viewname, definition FROM pg_views
        WHERE schemaname = 'public' AND viewname = ANY(:names)""",
    "triggers": """
        SELECT rel.relname, t.tgname, pg_get_triggerdef(t.oid)
        FROM pg_trigger t JOIN pg_class rel ON rel.oid = t.tgrelid
        WHERE NOT t.tgisinternal AND rel.relname = ANY(:names)""",
    "tables": """
        SELECT relname, relkind, coalesce(array_to_string(reloptions, ','), '')
        FROM pg_class WHERE relnamespace = 'public'::regnamespace
          AND relkind IN ('r', 'v') AND relname = ANY(:names)""",
}


def snapshot(url: str) -> dict[str, Any]:
    """``{"tables": {...}, "columns": [...], ...}`` for taskguard's objects at ``url``."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "postgresql":
                names = sorted(TASKGUARD_OBJECTS)
                found: dict[str, Any] = {}
                for part, sql in _PG.items():
                    rows = conn.execute(text(sql), {"names": names}).all()
                    found[part] = sorted(tuple(str(v) for v in row) for row in rows)
                found["tables"] = {row[0]: row[1:] for row in found["tables"]}
                return found
            rows = conn.execute(
                text("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name")
            ).all()
            mine = [r for r in rows if r.tbl_name in TASKGUARD_OBJECTS]
            columns = []
            for r in mine:
                if r.type in ("table", "view"):
                    info = conn.exec_driver_sql(f'PRAGMA table_xinfo("{r.name}")').all()
                    columns += [(r.name, *map(str, c)) for c in info]
            return {
                "tables": {r.name: (r.type, r.sql) for r in mine if r.type in ("table", "view")},
                "objects": sorted((r.type, r.name, r.tbl_name, r.sql or "") for r in mine),
                "columns": columns,
            }
    finally:
        engine.dispose()
