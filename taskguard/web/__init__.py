"""``taskguard web``: an operators' page for the locks (issue 44), as a Starlette app.

Needs the ``web`` extra (``pip install 'taskguard-sql[web]'``). The app only
translates HTTP into :class:`~taskguard.TaskGuard` calls and renders what they
return; see docs/web.md.
"""

from __future__ import annotations

try:
    from taskguard.web.app import create_app
    from taskguard.web.security import basic_auth
except ModuleNotFoundError as exc:  # pragma: no cover - the extra is not installed
    if exc.name not in ("starlette", "jinja2"):
        raise
    raise ModuleNotFoundError(
        f"taskguard.web needs {exc.name}: pip install 'taskguard-sql[web]'", name=exc.name
    ) from exc

__all__ = ["basic_auth", "create_app"]
