"""The OpenAPI document: FastAPI's, plus the event stream it cannot see.

OpenAPI 3.1 has no way to model a WebSocket, so the stream appears as the ``GET`` that
upgrades (``101``), with its close codes in words and a link to the frames' JSON Schema
(``/v1/ws-schema.json``, generated from ``kernelhub/wire.py``). The bearer scheme comes
from the ``HTTPBearer`` dependency of every authenticated route (``gateway/auth.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kernelhub.wire import CloseCode

STREAM_PATH = "/v1/sessions/{session_id}/stream"
WS_SCHEMA_PATH = "/v1/ws-schema.json"

DESCRIPTION = f"""Stateful sandboxed Python kernels for LLM agents.

The full protocol, with every status and body, is `docs/protocol.md`. Authenticate with
`Authorization: Bearer <token>` (`kernelhub token create --name NAME`).

**Event stream (WebSocket)**: `{STREAM_PATH}?since=<seq>` streams every event of the
session, replaying those with `seq > since` first; clients send `execute`, `interrupt`,
`input_reply`, `ping` ... frames on the same socket. Every frame, both ways, is in the
JSON Schema at [`{WS_SCHEMA_PATH}`]({WS_SCHEMA_PATH}).
"""


def _stream_operation() -> dict[str, Any]:
    codes = ", ".join(
        f"`{code}` {name}" for name, code in vars(CloseCode).items() if name.isupper()
    )
    return {
        "tags": ["stream"],
        "summary": "Event stream (WebSocket)",
        "operationId": "stream_session",
        "description": (
            "Upgrade to a WebSocket. The first frame is `hello`; then `event` frames, and "
            f"answers to client frames. Frames: [{WS_SCHEMA_PATH}]({WS_SCHEMA_PATH}). "
            "A refused stream is accepted and closed at once with a code and a reason: "
            f"{codes}. A browser may pass `?token=` instead of the header."
        ),
        "parameters": [
            {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}},
            {
                "name": "since",
                "in": "query",
                "required": False,
                "schema": {"type": "integer", "minimum": 0, "default": 0},
                "description": "replay the stored events with a greater seq first",
            },
        ],
        "security": [{"HTTPBearer": []}],
        "responses": {"101": {"description": "Switching Protocols: the WebSocket is open"}},
    }


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
                tags=app.openapi_tags,
            )
            doc["paths"][STREAM_PATH] = {"get": _stream_operation()}
            app.openapi_schema = doc
        return app.openapi_schema

    app.description = DESCRIPTION
    app.openapi = openapi  # type: ignore[method-assign]
