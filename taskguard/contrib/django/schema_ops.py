"""A Django migration operation that runs taskguard's Alembic migrations.

:class:`AlembicUpgrade` upgrades the database being migrated to one Alembic
revision with :func:`taskguard.schema.upgrade` (what ``taskguard db upgrade``
runs), and reverses with :func:`taskguard.schema.downgrade`. It works on the
connection's *current* settings, so it follows the test database; it only touches
the alias in ``TASKGUARD_DATABASE_ALIAS`` (other aliases get no lock tables).
"""

from __future__ import annotations

import logging
from typing import Any

from alembic.script import ScriptDirectory
from django.db import migrations

from taskguard import schema
from taskguard.contrib.django import conf
from taskguard.exceptions import ConfigurationError

__all__ = ["AlembicUpgrade"]

log = logging.getLogger("taskguard.django")


class AlembicUpgrade(migrations.RunPython):
    """Upgrade to ``revision``; reversing downgrades to ``previous``."""

    reduces_to_sql = False

    def __init__(self, revision: str, previous: str = "base") -> None:
        self.revision = revision
        self.previous = previous
        super().__init__(self._forward, self._backward, atomic=False, elidable=False)

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__name__}",
            [self.revision],
            {"previous": self.previous},
        )

    def describe(self) -> str:
        return f"taskguard's Alembic migrations up to {self.revision}"

    def _url(self, schema_editor: Any) -> str | None:
        connection = schema_editor.connection
        if getattr(conf._settings(), conf.URL_SETTING, None):
            log.warning(
                "%s is set: `manage.py migrate` leaves that database alone; "
                "run `manage.py taskguard db upgrade`",
                conf.URL_SETTING,
            )
            return None
        if connection.alias != conf.alias():
            return None
        url = conf.url_from_settings_dict(connection.settings_dict, connection.alias)
        return url.render_as_string(hide_password=False)

    def _forward(self, apps: Any, schema_editor: Any) -> None:
        url = self._url(schema_editor)
        if url is None:
            return
        state = schema.installed(url)
        if self.revision in _applied(state.revisions):
            # Already there (e.g. `taskguard db upgrade` ran before the switch to migrate,
            # or the application's own Alembic applies taskguard's revisions).
            log.info("taskguard schema already at or past %s; nothing to do", self.revision)
            return
        if state.by_application:
            raise ConfigurationError(
                f"taskguard's schema is at {', '.join(state.revisions)} in your application's "
                f"alembic_version; run `alembic upgrade heads` to bring it to {self.revision}"
            )
        schema.upgrade(url, self.revision)

    def _backward(self, apps: Any, schema_editor: Any) -> None:
        url = self._url(schema_editor)
        if url is not None:
            schema.downgrade(url, self.previous)


def _applied(heads: list[str]) -> set[str]:
    """Every revision at or below ``heads``."""
    if not heads:
        return set()
    scripts = ScriptDirectory.from_config(schema.alembic_config())
    return {
        rev.revision for rev in scripts.iterate_revisions(tuple(heads), "base") if rev is not None
    }
