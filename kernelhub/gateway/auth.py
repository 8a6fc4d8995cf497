"""Bearer tokens: every request names a principal; admin routes need an admin token.
Browser origins: only the gateway's own and the allowlist's."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Annotated

from fastapi import Depends, Request, Security, WebSocket
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kernelhub.errors import AuthError, ForbiddenError
from kernelhub.store.sqlite import Principal, SqliteStore

# The principal a `KERNELHUB_GATEWAY__METRICS_TOKEN` stands for: it reads /metrics only.
METRICS_READER = Principal(name="(metrics)", admin=False)


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def authenticate(store: SqliteStore, token: str | None) -> Principal:
    if token is None:
        raise AuthError(
            "missing bearer token; send `Authorization: Bearer <token>` (make one with `kernelhub token create --name NAME`)"
        )
    principal = await store.principal_for(token)
    if principal is None:
        raise AuthError("unknown or revoked token; ask an admin for a new one")
    return principal


# Declares the scheme in the OpenAPI document; the header is read by `bearer`, whose
# refusals (401 with a message to act on) are ours, not FastAPI's bare 403.
_SCHEME = HTTPBearer(
    auto_error=False,
    description="a kernelhub token (`kernelhub token create --name NAME`)",
)


async def principal(
    request: Request,
    _: Annotated[HTTPAuthorizationCredentials | None, Security(_SCHEME)] = None,
) -> Principal:
    """FastAPI dependency for REST routes."""
    store: SqliteStore = request.app.state.store
    return await authenticate(store, bearer(request.headers.get("authorization")))


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
    store: SqliteStore = request.app.state.store
    return await authenticate(store, token)


def websocket_token(ws: WebSocket) -> str | None:
    return bearer(ws.headers.get("authorization")) or ws.query_params.get("token")


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
