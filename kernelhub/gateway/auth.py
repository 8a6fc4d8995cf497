"""Bearer tokens: every request names a principal; admin routes need an admin token."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security, WebSocket
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kernelhub.errors import AuthError
from kernelhub.store.sqlite import Principal, SqliteStore


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


async def websocket_principal(ws: WebSocket) -> Principal:
    token = bearer(ws.headers.get("authorization")) or ws.query_params.get("token")
    store: SqliteStore = ws.app.state.store
    return await authenticate(store, token)


def client_address(request: Request | WebSocket) -> str | None:
    return f"{request.client.host}:{request.client.port}" if request.client else None
