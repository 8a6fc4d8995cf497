"""The kernelhub tools as an MCP server (the official ``mcp`` SDK, lowlevel ``Server``).

``python -m kernelhub.agents.mcp_server [--transport stdio|http] [--port N]`` serves
:data:`~kernelhub.agents.tools.TOOLS` — the same definitions, validation and result
shaping as :class:`~kernelhub.agents.tools.ToolRunner` — and talks to a kernelhub gateway
through the SDK (``--url``/``--token``, or ``KERNELHUB_URL``/``KERNELHUB_TOKEN``). HTTP
binds 127.0.0.1 only, and every HTTP request must carry a kernelhub token
(``Authorization: Bearer <token>``): the server checks it with the gateway
(``GET /v1/whoami``) and runs that connection's tools as the token's principal, so its
sessions are the caller's, not the server's; without a valid token the answer is 401.

Execution is stateful per MCP session: the first tool call on an MCP connection creates
one kernelhub session for it, later calls reuse it (variables survive), and the MCP
connection's teardown deletes it. A stdio server is one connection; streamable HTTP has
one per ``Mcp-Session-Id``. Clients speaking the 2026-07-28 stateless protocol have no
session: each of their requests is its own connection, so each call gets a fresh kernel.

Needs the ``agents`` extra (``pip install 'kernelhub[agents]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import Any

import httpx
import mcp_types as types
import uvicorn
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from kernelhub import __version__
from kernelhub.agents.tools import DEFAULT_MAX_CHARS, TOOLS, ToolResult, ToolRunner
from kernelhub.client import AsyncHub, AsyncSession, NotFoundError, SessionEndedError
from kernelhub.errors import KernelhubError

__all__ = ["build_server", "main"]

DEFAULT_URL = "http://127.0.0.1:8765"
_RUNNER = "kernelhub.runner"
_LOCK = "kernelhub.lock"


def _connection(ctx: ServerRequestContext[Any, Any]) -> Connection:
    """The MCP connection a request arrived on. mcp 2.x keeps per-connection ``state``
    and the teardown ``exit_stack`` on :class:`Connection` but hands lowlevel handlers
    only the per-request ``ServerSession``, which holds it privately; this is the one
    place that reaches in."""
    connection: Connection = ctx.session._connection
    return connection


def _caller_token(ctx: ServerRequestContext[Any, Any]) -> str | None:
    """The kernelhub token an HTTP request was authenticated with (None on stdio)."""
    request = ctx.request
    user = request.scope.get("user") if request is not None else None
    access = getattr(user, "access_token", None)
    return access.token if isinstance(access, AccessToken) else None


class GatewayTokenVerifier:
    """The MCP SDK's ``TokenVerifier``: a token is valid if the gateway says whose it is."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    async def verify_token(self, token: str) -> AccessToken | None:
        async with httpx.AsyncClient(timeout=30.0) as http:
            try:
                r = await http.get(
                    f"{self.url}/v1/whoami", headers={"Authorization": f"Bearer {token}"}
                )
            except httpx.HTTPError:
                return None
        if r.status_code != 200:
            return None
        return AccessToken(token=token, client_id=str(r.json()["name"]), scopes=[])


async def _delete(session: AsyncSession) -> None:
    with contextlib.suppress(NotFoundError, SessionEndedError):
        await session.delete()


def _content(result: ToolResult) -> types.CallToolResult:
    blocks: list[types.ContentBlock] = [types.TextContent(text=result.text)]
    blocks += [types.ImageContent(data=a.data_base64, mime_type=a.mime_type) for a in result.images]
    return types.CallToolResult(content=blocks, is_error=result.is_error)


def build_server(
    hub: AsyncHub,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    session_options: dict[str, Any] | None = None,
) -> Server[Any]:
    """An MCP server whose tools run on sessions of ``hub``, one per MCP connection; a
    connection authenticated with its own kernelhub token (HTTP) gets its session through
    a hub of that token instead, on ``hub``'s gateway. ``session_options`` are passed to
    :meth:`AsyncHub.create_session` (limits, metadata)."""

    async def runner_for(ctx: ServerRequestContext[Any, Any]) -> ToolRunner:
        connection = _connection(ctx)
        lock: asyncio.Lock = connection.state.setdefault(_LOCK, asyncio.Lock())
        async with lock:
            runner: ToolRunner | None = connection.state.get(_RUNNER)
            if runner is None:
                owner = hub
                token = _caller_token(ctx)
                if token is not None:
                    owner = AsyncHub(hub.base_url, token)
                    connection.exit_stack.push_async_callback(owner.close)
                session = await owner.create_session(**(session_options or {}))
                connection.exit_stack.push_async_callback(_delete, session)
                runner = ToolRunner(session, max_chars=max_chars)
                connection.state[_RUNNER] = runner
            return runner

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(name=s.name, description=s.description, input_schema=s.json_schema())
                for s in TOOLS.values()
            ]
        )

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name not in TOOLS:  # answer before starting a kernel for nothing
            text = f"unknown tool {params.name!r}; the tools are: {', '.join(TOOLS)}"
            return _content(ToolResult(text=text, is_error=True))
        try:
            runner = await runner_for(ctx)
            result = await runner.run(params.name, params.arguments)
        except KernelhubError as exc:
            result = ToolResult(text=f"kernelhub failed: {exc}", is_error=True)
        return _content(result)

    def input_schema(name: str) -> dict[str, Any] | None:
        spec = TOOLS.get(name)
        return None if spec is None else spec.json_schema()

    return Server(
        "kernelhub",
        version=__version__,
        instructions="Stateful, sandboxed Python: variables persist between execute_python calls.",
        get_tool_input_schema=input_schema,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def serve(
    url: str, token: str | None, transport: str, port: int, *, max_chars: int = DEFAULT_MAX_CHARS
) -> None:
    """Serve on stdio with ``token``, or on HTTP with each client's own token."""
    async with AsyncHub(url, token or "") as hub:
        server = build_server(hub, max_chars=max_chars)
        if transport == "stdio":
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())
            return
        app = server.streamable_http_app(
            host="127.0.0.1",
            auth=AuthSettings(issuer_url=hub.base_url, resource_server_url=None),
            token_verifier=GatewayTokenVerifier(hub.base_url),
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        await uvicorn.Server(config).serve()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="kernelhub mcp",
        description="Serve kernelhub's tools (execute_python, files, interrupt, snapshot) over MCP.",
    )
    parser.add_argument(
        "--transport",
        choices=["stdio", "http"],
        default="stdio",
        help="stdio (default: the client starts this command) or streamable HTTP on --port",
    )
    parser.add_argument("--port", type=int, default=8766, help="HTTP port on 127.0.0.1")
    parser.add_argument("--url", help=f"gateway URL (default: $KERNELHUB_URL or {DEFAULT_URL})")
    parser.add_argument(
        "--token",
        help="gateway token for stdio (default: $KERNELHUB_TOKEN); over HTTP each client "
        "sends its own (Authorization: Bearer)",
    )
    parser.add_argument(
        "--max-chars", type=int, default=DEFAULT_MAX_CHARS, help="text budget per tool result"
    )
    args = parser.parse_args(argv)
    url = args.url or os.environ.get("KERNELHUB_URL") or DEFAULT_URL
    token = args.token or os.environ.get("KERNELHUB_TOKEN")
    if not token and args.transport == "stdio":
        parser.error("a gateway token is required: pass --token or set KERNELHUB_TOKEN")
    asyncio.run(serve(url, token, args.transport, args.port, max_chars=args.max_chars))


if __name__ == "__main__":
    main()
