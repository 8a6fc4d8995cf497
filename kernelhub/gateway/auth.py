"""Bearer tokens: every request names a principal; admin routes need an admin token."""

from __future__ import annotations

from fastapi import Request, WebSocket

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


async def principal(request: Request) -> Principal:
    """FastAPI dependency for REST routes."""
    store: SqliteStore = request.app.state.store
    return await authenticate(store, bearer(request.headers.get("authorization")))


async def admin(request: Request) -> Principal:
    p = await principal(request)
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
