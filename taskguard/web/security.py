"""Who may act, and proof that a POST came from our own form.

* ``authorize(request)``: the application's hook, returning the operator's name
  (recorded with each force release) or ``None`` to refuse; it may raise
  :class:`starlette.exceptions.HTTPException` itself (:func:`basic_auth` answers
  401 so that a browser asks for credentials).
* CSRF: a double-submit token. Every page sets a random token in a cookie (HttpOnly,
  SameSite=Strict) and puts the same token in each form; a POST whose form token
  does not equal its cookie is refused with 403.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import secrets
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

__all__ = ["Authorize", "basic_auth", "check_csrf", "csrf_token", "set_csrf"]

#: Returns the operator's name to consent, ``None`` to refuse.
Authorize = Callable[[Request], "str | None"]

CSRF_COOKIE = "taskguard_csrf"


def basic_auth(user: str, password: str, *, realm: str = "taskguard") -> Authorize:
    """An ``authorize`` hook checking HTTP basic credentials; the operator is ``user``.
    Use it only over HTTPS or on loopback: basic credentials travel in clear."""
    expected = f"{user}:{password}".encode()

    def authorize(request: Request) -> str | None:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        try:
            given = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            given = b""
        if scheme.lower() != "basic" or not hmac.compare_digest(given, expected):
            raise HTTPException(
                401, "credentials needed", headers={"WWW-Authenticate": f'Basic realm="{realm}"'}
            )
        return user

    return authorize


def csrf_token(request: Request) -> str:
    """The token of this browser session (the cookie's, else a new one)."""
    token = request.cookies.get(CSRF_COOKIE, "")
    return token if len(token) == 43 else secrets.token_urlsafe(32)


def set_csrf(request: Request, response: Response, token: str) -> None:
    if request.cookies.get(CSRF_COOKIE) != token:
        path = request.scope.get("root_path") or "/"
        response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict", path=path)


def check_csrf(request: Request, form: dict[str, str]) -> None:
    """403 unless the form's token equals the cookie's."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    given = form.get("csrf", "")
    if not cookie or not hmac.compare_digest(cookie.encode(), given.encode()):
        raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")
