"""The ASGI app: routes that turn requests into guard calls and render the result."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from taskguard.config import build_guard, setting
from taskguard.display import format_duration, phase_text, printable, slots_text
from taskguard.exceptions import ConfigurationError, InvalidKey, TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.validation import normalize_key
from taskguard.web import pages
from taskguard.web.security import Authorize, check_csrf, csrf_token, set_csrf

__all__ = ["create_app"]

log = logging.getLogger("taskguard")

_TEMPLATES = Path(__file__).with_name("templates")
_STATES = ("held", "expired", "all")
_PHASES = ", ".join(pages.PHASES)
# A form is a reason, a key (at most 255 characters, up to 4 bytes each, escaped)
# and a token: anything longer is not ours.
_FORM_MAX = 64 * 1024


class _Key(Convertor[str]):
    """A key in the path: anything, newlines too (``path`` stops at a newline)."""

    regex = r"[\s\S]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return quote(value, safe="")


register_url_convertor("taskguard_key", _Key())


def create_app(
    guard_or_url: TaskGuard | str,
    *,
    allow_actions: bool = False,
    authorize: Authorize | None = None,
) -> Starlette:
    """The operators' page as a Starlette (ASGI) app; mount it anywhere.

    ``guard_or_url``: a :class:`TaskGuard` (the caller disposes it) or a database URL
    (a guard built with the default settings, disposed when the app shuts down).
    ``allow_actions``: offer force-release and reap; each action then asks
    ``authorize(request)`` for the operator's name (``None`` refuses), which is
    required with ``allow_actions``. Without it, the app is read-only: no action is
    shown and every POST is refused."""
    if allow_actions and authorize is None:
        raise ConfigurationError(
            "allow_actions=True needs authorize=: a function of the request returning "
            "the operator's name, or None to refuse (e.g. taskguard.web.basic_auth)"
        )
    owned = not isinstance(guard_or_url, TaskGuard)
    guard = build_guard(url=guard_or_url) if isinstance(guard_or_url, str) else guard_or_url
    site = _Site(guard, authorize if allow_actions else None)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        if owned:
            guard.dispose()

    routes = [
        Route("/", site.overview, name="overview"),
        Route("/locks", site.locks, name="locks"),
        Route("/keys/{key:taskguard_key}", site.key, name="key"),
        Route("/release", site.confirm_release, name="confirm_release"),
        Route("/release", site.release, methods=["POST"], name="release"),
        Route("/reap", site.reap, methods=["POST"], name="reap"),
        Route("/api/locks", site.api_locks, name="api_locks"),
        Route("/api/keys/{key:taskguard_key}", site.api_key, name="api_key"),
        Route("/healthz", site.healthz, name="healthz"),
    ]
    handlers: dict[Any, Callable[..., Any]] = {
        TaskGuardError: site.unavailable,
        HTTPException: site.http_error,
    }
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


class _Site:
    def __init__(self, guard: TaskGuard, authorize: Authorize | None) -> None:
        self.guard = guard
        self.authorize = authorize
        self.env = Environment(
            loader=FileSystemLoader(_TEMPLATES),
            autoescape=select_autoescape(default=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters["p"] = printable
        self.env.filters["duration"] = format_duration
        self.env.filters["when"] = lambda d: d.isoformat(sep=" ", timespec="seconds")
        self.env.globals["role"] = pages.role
        self.env.globals["phase_text"] = phase_text
        self.env.globals["slots_text"] = slots_text
        self.env.globals["phases"] = list(pages.PHASES)
        self.env.globals["chart"] = pages.chart

    # -- rendering -------------------------------------------------------------------

    def page(self, request: Request, template: str, status: int = 200, **values: Any) -> Response:
        token = csrf_token(request)
        root = str(request.scope.get("root_path", "")).rstrip("/")

        def link(path: str, key: str | None = None) -> str:
            return root + path + ("" if key is None else quote(key, safe=""))

        html = self.env.get_template(template).render(
            link=link, csrf=token, actions=self.authorize is not None, **values
        )
        response = HTMLResponse(html, status_code=status)
        set_csrf(request, response, token)
        response.headers["Content-Security-Policy"] = (
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
            "frame-ancestors 'none'"
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    def unavailable(self, request: Request, exc: Exception) -> Response:
        message = printable(" ".join(str(exc).split()), backslashes=False)
        status = 400 if isinstance(exc, InvalidKey) else 503
        if request.url.path.endswith("/healthz") or "/api/" in request.url.path:
            return JSONResponse({"error": message}, status_code=status)
        return self.page(request, "message.html", status, title="Error", message=message)

    def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        response = self.page(
            request, "message.html", exc.status_code, title="Refused", message=exc.detail
        )
        response.headers.update(exc.headers or {})
        return response

    # -- pages -----------------------------------------------------------------------

    def overview(self, request: Request) -> Response:
        return self.page(
            request,
            "overview.html",
            o=pages.overview(self.guard),
            check=pages.health(self.guard),
            url=self.guard.url,
        )

    def _filters(self, request: Request) -> dict[str, Any]:
        q = request.query_params
        state = q.get("state", "held")
        if state not in _STATES:
            raise HTTPException(400, f"state must be one of {', '.join(_STATES)}")
        phase = q.get("phase", "")
        if phase and phase not in pages.PHASES:
            raise HTTPException(400, f"phase must be one of {_PHASES} (or empty: any)")
        return {
            "state": state,
            "prefix": q.get("prefix", ""),
            "task": q.get("task", ""),
            "phase": phase,
            "companions": q.get("companions") == "1",
        }

    def locks(self, request: Request) -> Response:
        filters = self._filters(request)
        found = pages.locks(self.guard, **filters)
        rows, full = found.rows, len(found.rows) >= pages.ROWS
        return self.page(
            request, "locks.html", rows=rows, in_use=found.in_use, f=filters, full=full
        )

    def key(self, request: Request) -> Response:
        view = pages.key_view(self.guard, _path_key(request, 2))
        return self.page(request, "key.html", v=view, done=request.query_params.get("done"))

    def api_locks(self, request: Request) -> Response:
        return JSONResponse(pages.locks(self.guard, **self._filters(request)).to_json())

    def api_key(self, request: Request) -> Response:
        view = pages.key_view(self.guard, _path_key(request, 3))
        if not view.payload["events"] and not view.rows and not view.payload["companions"]:
            error = f"nothing recorded for {view.key!r} (no history and no lock row)"
            return JSONResponse({"error": error, "key": view.key}, 404)  # as `explain`
        return JSONResponse(view.payload)

    def healthz(self, request: Request) -> Response:
        """200 when the database answers and the schema is at head (and, given
        ``?reaper_interval=S``, the reaper ran within S seconds or cannot be told);
        503 otherwise, or when the check takes longer than the guard's call timeout."""
        interval = request.query_params.get("reaper_interval")
        try:
            seconds = None if interval is None else float(interval)
        except ValueError:
            seconds = -1.0
        if seconds is not None and not 0 < seconds < float("inf"):
            error = f"reaper_interval must be a positive number of seconds, not {interval!r}"
            return JSONResponse({"error": error}, 400)
        limit = self.guard.call_timeout
        found: list[Any] = []

        def check() -> None:
            result = pages.health(self.guard)
            seen = pages.reaper_seen(self.guard, seconds) if seconds and result.ok else ""
            found.extend((result, seen))

        worker = threading.Thread(target=check, daemon=True)
        worker.start()
        worker.join(limit)
        if not found:
            return JSONResponse({"ok": False, "problems": [f"no answer within {limit:g}s"]}, 503)
        result, seen = found
        body: dict[str, Any] = {
            "ok": result.ok,
            "problems": result.problems,
            "schema": result.schema_revision,
        }
        if seconds and result.ok:
            body["reaper"] = seen or "not seen"
            if seen is None:
                body.update(ok=False, problems=[f"no reaper run recorded in the last {seconds:g}s"])
        return JSONResponse(body, status_code=200 if body["ok"] else 503)

    # -- actions ---------------------------------------------------------------------

    def _operator(self, request: Request) -> str:
        if self.authorize is None:
            raise HTTPException(403, "this page is read-only (started without allow_actions)")
        operator = self.authorize(request)
        if not operator:
            raise HTTPException(403, "not allowed: the authorize hook refused this request")
        return operator

    async def _form(self, request: Request) -> tuple[str, dict[str, str]]:
        """The operator (asked first: no body is read for a refused request) and the
        form, its CSRF token checked."""
        operator = self._operator(request)
        body = await request.body()
        if len(body) > _FORM_MAX:
            raise HTTPException(413, "form too large")
        try:
            form = dict(parse_qsl(body.decode(), keep_blank_values=True, errors="strict"))
        except UnicodeDecodeError:
            raise HTTPException(400, "the form is not UTF-8 text") from None
        check_csrf(request, form)
        return operator, form

    def confirm_release(self, request: Request) -> Response:
        self._operator(request)
        view = pages.key_view(self.guard, normalize_key(request.query_params.get("key", "")))
        return self.page(request, "release.html", v=view)

    async def release(self, request: Request) -> Response:
        operator, form = await self._form(request)
        # The key travels in the form's URL: a form field's line breaks would be rewritten.
        key = normalize_key(request.query_params.get("key", ""))
        reason = " ".join(form.get("reason", "").split())
        if not reason:
            raise HTTPException(400, "a force release needs a reason (it goes in the history)")
        ended = await _in_thread(self.guard.force_release, key, by=f"{operator}: {reason}")
        done = "released" if ended else "not-held"
        root = request.scope.get("root_path", "").rstrip("/")
        location = f"{root}/keys/{quote(key, safe='')}?done={done}"
        return Response(status_code=303, headers={"Location": location})

    async def reap(self, request: Request) -> Response:
        operator, _ = await self._form(request)
        grace = float(setting(None, "taskguard_reaper_grace"))
        size = int(setting(None, "taskguard_reaper_batch_size"))
        result = await _in_thread(self.guard.reap, grace=grace, batch_size=size, by=operator)
        log.warning("reap requested by %s from the web page: %d row(s) removed", operator, result)
        message = f"removed {int(result)} expired lock row(s) in {result.batches} batch(es) (grace {grace:g}s)"
        return self.page(request, "message.html", title="Reaped", message=message)


def _path_key(request: Request, depth: int) -> str:
    """The key at the end of the path, ``depth`` segments below the app's root,
    percent-decoded once from the raw path where the server gives it (Starlette's
    TestClient decodes ``path`` twice: ``%252F`` would arrive as ``/``)."""
    raw = request.scope.get("raw_path")
    if raw is None:
        return normalize_key(request.path_params["key"])
    root = request.scope.get("root_path", "").rstrip("/")
    return normalize_key(unquote(raw.decode("latin-1").split("/", root.count("/") + depth)[-1]))


async def _in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args, **kwargs)
