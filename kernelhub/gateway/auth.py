"""Bearer tokens (or the review page's sign-in cookie): every request names a principal;
admin routes need an admin token; a scoped token's limits (read-only, one session, an
expiry) are decided here, in :func:`check_scope`, for every route and the stream.
Browser origins: only the gateway's own and the allowlist's."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Annotated

from fastapi import Depends, Request, Security, WebSocket
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kernelhub.errors import AuthError, ForbiddenError, NotFoundError
from kernelhub.store.base import Store
from kernelhub.store.records import Principal

SESSION_COOKIE = "kh_session"  # HttpOnly: the sign-in id
CSRF_COOKIE = "kh_csrf"  # readable by the page, sent back as the header below
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# What a session-scoped token may call besides routes on its own session: both answer
# about that session only.
SCOPED_EXTRA = frozenset({"/v1/sessions", "/v1/whoami"})

# The principal a `KERNELHUB_GATEWAY__METRICS_TOKEN` stands for: it reads /metrics only.
METRICS_READER = Principal(name="(metrics)", admin=False)


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def authenticate(store: Store, token: str | None) -> Principal:
    if token is None:
        raise AuthError(
            "missing bearer token; send `Authorization: Bearer <token>` (make one with `kernelhub token create --name NAME`)"
        )
    principal = await store.principal_for(token)
    if principal is None:
        raise AuthError(
            "unknown or revoked token (or an ended sign-in); ask an admin for a new one"
        )
    if principal.expired() and principal.expires_at is not None:
        raise AuthError(
            f"token {principal.token or principal.name!r} expired at "
            f"{principal.expires_at.isoformat(timespec='seconds')}; make a new one "
            "(`kernelhub token create --expires 2h ...` or POST /v1/admin/tokens)"
        )
    return principal


def check_scope(p: Principal, *, act: bool, session_id: str | None, extra: bool = False) -> None:
    """The one decision on a scoped token: ``act`` is a request that changes something
    (anything but a read or an export); ``session_id`` the session it is about (None: a
    route on no one session; ``extra``: one of SCOPED_EXTRA, which filter to it). Another
    session is NotFoundError, as for anyone else's, so ids cannot be probed."""
    who = p.token or p.name
    if act and p.read_only:
        raise ForbiddenError(
            f"token {who!r} is read-only: it may view and export, not act "
            "(make one without --read-only for that)"
        )
    if p.session_id is None:
        return
    if session_id is None and not extra:
        raise ForbiddenError(f"token {who!r} is scoped to session {p.session_id!r} only")
    if session_id is not None and session_id != p.session_id:
        raise NotFoundError(f"no session {session_id!r} (or it is not yours)")


def require_unscoped(p: Principal, api: str) -> Principal:
    """The Jupyter and E2B APIs run code and list every session of the principal: a
    read-only or one-session token is refused there, never half-honoured."""
    if p.read_only or p.session_id is not None:
        raise ForbiddenError(
            f"token {p.token or p.name!r} is scoped (read-only or one session); the {api} "
            "needs an unscoped token (`kernelhub token create --name NAME`)"
        )
    return p


def check_csrf(sent: str | None, expected: str) -> None:
    """A request authenticated by the cookie that changes something must carry the
    sign-in's CSRF token: a foreign page can make the browser send the cookie, not read
    the token."""
    if sent is None or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise ForbiddenError(
            f"missing or wrong {CSRF_HEADER} header: a request signed in by cookie that "
            "changes something must send the csrf_token the sign-in returned"
        )


async def _scope_of(request: Request, store: Store, p: Principal) -> None:
    act = request.method not in SAFE_METHODS  # exports are GETs: reads
    if p.session_id is None and not p.read_only:
        return
    params = request.path_params
    session_id = params.get("session_id")
    if session_id is None and "execution_id" in params:
        row = await store.get_execution(params["execution_id"])
        # An unknown id: the route answers 404 itself; never hint that one exists.
        session_id = row.session_id if row is not None else p.session_id
    route = request.scope.get("route")
    extra = getattr(route, "path", None) in SCOPED_EXTRA and not act
    check_scope(p, act=act, session_id=session_id, extra=extra)


# Declares the scheme in the OpenAPI document; the header is read by `bearer`, whose
# refusals (401 with a message to act on) are ours, not FastAPI's bare 403.
_SCHEME = HTTPBearer(
    auto_error=False,
    description="a kernelhub token (`kernelhub token create --name NAME`)",
)
BearerDeclared = Annotated[HTTPAuthorizationCredentials | None, Security(_SCHEME)]


async def principal(
    request: Request,
    _: Annotated[HTTPAuthorizationCredentials | None, Security(_SCHEME)] = None,
) -> Principal:
    """FastAPI dependency for REST routes: a bearer token, else the sign-in cookie (then a
    request that changes something needs the CSRF header); the token's scope applies."""
    store: Store = request.app.state.store
    token = bearer(request.headers.get("authorization"))
    cookie = request.cookies.get(SESSION_COOKIE) if token is None else None
    if cookie is not None:
        signed_in = await store.web_session(cookie)
        if signed_in is None:
            raise AuthError(
                "the sign-in has ended (expired, signed out or token revoked); sign in again"
            )
        if request.method not in SAFE_METHODS:
            check_csrf(request.headers.get(CSRF_HEADER), signed_in[1])
        token = cookie
    p = await authenticate(store, token)
    await _scope_of(request, store, p)
    return p


async def admin(p: Annotated[Principal, Depends(principal)]) -> Principal:
    if not p.admin:
        raise AuthError(
            "this route needs an admin token (`kernelhub token create --admin`)",
            admin_required=True,
        )
    return p


async def metrics_reader(
    request: Request,
    _: Annotated[HTTPAuthorizationCredentials | None, Security(_SCHEME)] = None,
) -> Principal:
    """FastAPI dependency for /metrics: any valid token, or the metrics token."""
    token = bearer(request.headers.get("authorization"))
    secret = request.app.state.settings.gateway.metrics_token
    if (
        token is not None
        and secret is not None
        and hmac.compare_digest(token.encode(), secret.get_secret_value().encode())
    ):
        return METRICS_READER
    store: Store = request.app.state.store
    return await authenticate(store, token)


def websocket_token(ws: WebSocket) -> str | None:
    """The bearer header, ``?token=``, or the sign-in cookie (a browser's handshake sends
    it; the Origin check keeps foreign pages from using it)."""
    return (
        bearer(ws.headers.get("authorization"))
        or ws.query_params.get("token")
        or ws.cookies.get(SESSION_COOKIE)
    )


def check_origin(origin: str | None, host: str | None, allowed: Sequence[str]) -> None:
    """Raise :class:`ForbiddenError` unless a request with this ``Origin`` header may go on:
    none (not a browser), the gateway's own (``Host``), or one of ``allowed`` (``*``: any).
    Browsers make no CORS check before a WebSocket handshake, and any page the user opens
    can reach a gateway on loopback: only this keeps a foreign page off the streams."""
    if origin is None:
        return
    normal = origin.strip().rstrip("/").lower()
    allow = {a.strip().rstrip("/").lower() for a in allowed}
    if "*" in allow or normal in allow:
        return
    if host and normal in (f"http://{host.lower()}", f"https://{host.lower()}"):
        return
    raise ForbiddenError(
        f"requests from origin {origin[:100]!r} are not allowed; add it to "
        "KERNELHUB_GATEWAY__ALLOWED_ORIGINS (a JSON list: '[\"https://app.example.com\"]')"
    )


def client_address(request: Request | WebSocket) -> str | None:
    return f"{request.client.host}:{request.client.port}" if request.client else None
