"""The kernelhub tools as an MCP server (the official ``mcp`` SDK, lowlevel ``Server``).

``kernelhub mcp [--transport stdio|http] [--port N]`` serves
:data:`~kernelhub.agents.tools.TOOLS` — the same definitions, validation and result
shaping as :class:`~kernelhub.agents.tools.ToolRunner` — plus ``answer_input``, and talks
to a kernelhub gateway through the SDK (``--url``/``--token``, or
``KERNELHUB_URL``/``KERNELHUB_TOKEN``). HTTP binds 127.0.0.1 only, and every HTTP request
must carry a kernelhub token (``Authorization: Bearer <token>``): the server checks it with
the gateway (``GET /v1/whoami``) and runs that caller's tools as the token's principal, so
its sessions are the caller's, not the server's; without a valid token the answer is 401.

- **State.** The first tool call on an MCP connection creates one kernelhub session for
  it, later calls reuse it, and the connection's teardown deletes it (stdio is one
  connection; streamable HTTP one per ``Mcp-Session-Id``). Clients of the stateless
  2026-07-28 protocol have no connection state: their first result names a *session
  handle*, and the optional ``session`` argument of every tool takes it back. Handles
  unused for ``--handle-idle-timeout`` seconds expire (their session is deleted).
- **Live output.** While a cell runs, its output goes out as ``notifications/progress``
  (when the call carries a progress token) and ``notifications/message`` (logging), at
  most one of each per ``--notify-interval`` seconds, coalesced.
- **Input.** ``input()`` and ``confirm()`` in a cell are asked through MCP elicitation
  when the client declares it; otherwise the call returns at once saying the cell waits,
  and ``answer_input`` answers it.
- **Failures.** A cancelled call (``notifications/cancelled``, or the client dropping the
  request) interrupts its cell. After a kernel death the next call works: kernelhub's
  recovered session, or a fresh one created here; the result says which.
- **Resources.** ``kernelhub://sessions/{id}/notebook.ipynb`` (the session's executions
  as a notebook) and ``kernelhub://sessions/{id}/workspace/{path}`` (its files).

Needs the ``agents`` extra (``pip install 'kernelhub[agents]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import warnings
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import httpx
import mcp_types as types
import uvicorn
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from kernelhub import __version__
from kernelhub.agents import mcp_resources as resources
from kernelhub.agents.mcp_kernels import (
    CALL,
    DEFAULT_HANDLE_IDLE_TIMEOUT,
    AwaitingInput,
    CallHooks,
    InputAnswerer,
    Kernel,
    Kernels,
    died,
    settle,
)
from kernelhub.agents.mcp_live import (
    DEFAULT_NOTIFY_INTERVAL,
    LiveOutput,
    answer_of,
    elicitation_for,
)
from kernelhub.agents.mcp_tools import (
    ANSWER_INPUT,
    HANDLE_NOTE,
    AnswerInputArgs,
    mcp_tools,
    tool_result,
    waiting_result,
)
from kernelhub.agents.results import DEFAULT_MAX_CHARS, ToolResult, render_execution
from kernelhub.agents.tools import TOOLS
from kernelhub.client import AsyncHub, SessionEndedError
from kernelhub.errors import KernelhubError
from kernelhub.models import FinalEvent, InputRequestEvent

__all__ = ["build_server", "main"]

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8765"
_KERNEL = "kernelhub.kernel"
_LOCK = "kernelhub.lock"


def _connection(ctx: ServerRequestContext[Any, Any]) -> Connection:
    """The MCP connection a request arrived on. mcp 2.x keeps per-connection ``state``
    and the teardown ``exit_stack`` on :class:`Connection` but hands lowlevel handlers
    only the per-request ``ServerSession``, which holds it privately; this is the one
    place that reaches in."""
    connection: Connection = ctx.session._connection
    return connection


def _principal(ctx: ServerRequestContext[Any, Any]) -> str:
    """Whose kernels a request may use: the kernelhub token an HTTP request was
    authenticated with (the transport's token auth puts it in the request scope), or ""
    for the server's own token (stdio). Kernels are created with that token, and session
    handles are only found again by the same one."""
    request = ctx.request
    user = request.scope.get("user") if request is not None else None
    access = getattr(user, "access_token", None)
    return access.token if isinstance(access, AccessToken) else ""


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


def _stateless(ctx: ServerRequestContext[Any, Any]) -> bool:
    return ctx.protocol_version in MODERN_PROTOCOL_VERSIONS


def _elicitor(ctx: ServerRequestContext[Any, Any]) -> InputAnswerer | None:
    """Asks the cell's question through MCP elicitation, when the client can be asked."""
    caps = ctx.session.client_capabilities
    if caps is None or caps.elicitation is None or not ctx.session.can_send_request:
        return None

    async def ask(prompt: str) -> str:
        message, schema = elicitation_for(prompt)
        try:
            answer = await ctx.session.elicit_form(
                message, schema, related_request_id=ctx.request_id
            )
        except (MCPError, ValidationError) as exc:
            log.warning("elicitation failed, answering the empty string: %s", exc)
            return ""
        return answer_of(prompt, answer.action, answer.content)

    return ask


async def _notify(ctx: ServerRequestContext[Any, Any], text: str, n: int) -> None:
    """One chunk of live output, as progress (a no-op without a progress token) and as a
    log message (the logging capability is deprecated in 2026-07-28, still the one most
    clients show)."""
    try:
        await ctx.session.report_progress(n, message=text)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            await ctx.session.send_log_message(
                "info", text, logger="kernelhub.output", related_request_id=ctx.request_id
            )
    except Exception as exc:  # a lost notification must not fail the cell
        log.debug("live output notification not sent: %s", exc)


def build_server(
    hub: AsyncHub,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    session_options: dict[str, Any] | None = None,
    handle_idle_timeout: float | None = DEFAULT_HANDLE_IDLE_TIMEOUT,
    notify_interval: float = DEFAULT_NOTIFY_INTERVAL,
) -> Server[Any]:
    """An MCP server whose tools run on sessions of ``hub``: one per MCP connection, or
    per session handle for stateless clients. ``session_options`` are passed to
    :meth:`AsyncHub.create_session` (limits, metadata)."""
    kernels = Kernels(
        hub,
        runner_options={"max_chars": max_chars},
        session_options=session_options,
        idle_timeout=handle_idle_timeout,
    )

    async def fresh(ctx: ServerRequestContext[Any, Any], old: Kernel | None) -> Kernel:
        """A new kernel in ``old``'s place (or the first one) for this request."""
        kernel = await kernels.create(_principal(ctx))
        connection = _connection(ctx)
        # A connection's first kernel, or its replacement, belongs to the connection.
        owned = connection.state.get(_KERNEL) is old if old is not None else not _stateless(ctx)
        if owned:
            connection.state[_KERNEL] = kernel
            connection.exit_stack.push_async_callback(kernels.forget, kernel)
        else:
            kernels.keep(kernel)
        if old is not None:
            await kernels.forget(old)
        return kernel

    async def kernel_for(
        ctx: ServerRequestContext[Any, Any], handle: str | None, notes: list[str]
    ) -> Kernel:
        principal = _principal(ctx)
        if handle is not None:
            kernel = kernels.get(principal, handle)
            if kernel is not None:
                return kernel
            why = "expired after idling" if (principal, handle) in kernels.expired else "is unknown"
            kernel = await kernels.create(principal)
            kernels.keep(kernel)
            notes.append(
                f"[session] the session handle {handle!r} {why} (handles expire after "
                f"{handle_idle_timeout} s unused; --handle-idle-timeout); this call ran in a "
                "fresh session: earlier variables are gone"
            )
            return kernel
        if _stateless(ctx):
            return await fresh(ctx, None)
        connection = _connection(ctx)
        lock: asyncio.Lock = connection.state.setdefault(_LOCK, asyncio.Lock())
        async with lock:
            current: Kernel | None = connection.state.get(_KERNEL)
            return current if current is not None else await fresh(ctx, None)

    async def pump(ctx: ServerRequestContext[Any, Any], live: LiveOutput) -> None:
        while True:
            await anyio.sleep(notify_interval)
            text = live.take()
            if text is not None:
                await _notify(ctx, text, live.chunks)

    async def answer_input(
        kernel: Kernel, arguments: dict[str, Any], hooks: CallHooks
    ) -> ToolResult:
        try:
            args = AnswerInputArgs.model_validate(arguments)
        except ValidationError as exc:
            return ToolResult(text=f"invalid arguments for answer_input: {exc}", is_error=True)
        waiting = kernel.pending
        if waiting is None:
            return ToolResult(text="no cell is waiting for input; nothing to answer", is_error=True)
        kernel.pending = None
        hooks.executions.append(waiting.execution_id)
        try:
            await kernel.session.send_input(waiting.execution_id, args.value)
            async with contextlib.aclosing(kernel.session.events(since=waiting.seq)) as events:
                async for event in events:
                    if event.execution_id != waiting.execution_id:
                        continue
                    hooks.live.add(event)
                    if isinstance(event, InputRequestEvent):
                        raise AwaitingInput(
                            event.execution_id, event.prompt, event.seq, "".join(hooks.live.seen)
                        )
                    if isinstance(event, FinalEvent):
                        break
            execution = await kernel.session.wait(waiting.execution_id)
        except anyio.get_cancelled_exc_class():
            await hooks.interrupt(kernel.session)
            raise
        hooks.finished = execution
        return render_execution(execution, max_chars=max_chars)

    async def stop_waiting(kernel: Kernel) -> ToolResult:
        """``interrupt`` while a cell waits for ``answer_input``: the runner no longer
        tracks that cell (its call returned), so interrupt it here."""
        assert kernel.pending is not None
        execution_id, kernel.pending = kernel.pending.execution_id, None
        await kernel.session.interrupt(execution_id)
        execution = await kernel.session.wait(execution_id)
        return render_execution(execution, max_chars=max_chars)

    async def run_call(
        ctx: ServerRequestContext[Any, Any], kernel: Kernel, name: str, arguments: dict[str, Any]
    ) -> tuple[ToolResult, CallHooks]:
        hooks = CallHooks(LiveOutput(interval=notify_interval), on_input=_elicitor(ctx))
        token = CALL.set(hooks)
        failure: Exception | None = None
        kernel.busy += 1
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(pump, ctx, hooks.live)
                try:
                    if name == "answer_input":
                        result = await answer_input(kernel, arguments, hooks)
                    elif name == "interrupt" and kernel.pending is not None:
                        result = await stop_waiting(kernel)
                    else:
                        result = await kernel.runner.run(name, arguments)
                except AwaitingInput as waiting:
                    kernel.pending = waiting
                    result = waiting_result(waiting, max_chars)
                except Exception as exc:  # raised below, not wrapped in an ExceptionGroup
                    failure = exc
                finally:
                    tasks.cancel_scope.cancel()
            if failure is not None:
                raise failure
            rest = hooks.live.take(force=True)
            if rest is not None:
                await _notify(ctx, rest, hooks.live.chunks)
        finally:
            kernel.busy -= 1
            kernel.last_used = kernels.clock()
            CALL.reset(token)
        return result, hooks

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=mcp_tools())

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        name = params.name
        if name not in TOOLS and name != ANSWER_INPUT.name:  # no kernel started for nothing
            names = ", ".join([*TOOLS, ANSWER_INPUT.name])
            return tool_result(
                ToolResult(text=f"unknown tool {name!r}; the tools are: {names}", is_error=True)
            )
        arguments = dict(params.arguments or {})
        handle = arguments.pop("session", None)
        if handle is not None and not isinstance(handle, str):
            return tool_result(ToolResult(text="`session` must be a string handle", is_error=True))
        notes: list[str] = []
        try:
            kernel = await kernel_for(ctx, handle, notes)
            try:
                result, hooks = await run_call(ctx, kernel, name, arguments)
            except SessionEndedError as exc:
                # The kernel died before (or kernelhub gave the session up): the next call
                # works, in a fresh session, and says so.
                kernel = await fresh(ctx, kernel)
                notes.append(
                    f"[session] the previous session had ended ({exc.message}); this call ran "
                    "in a fresh session: variables and imports from earlier calls are gone"
                )
                result, hooks = await run_call(ctx, kernel, name, arguments)
            if died(hooks):
                notes.append(await settle(kernel))
        except KernelhubError as exc:
            return tool_result(ToolResult(text=f"kernelhub failed: {exc}", is_error=True), notes)
        if handle is not None or _stateless(ctx):
            notes.append(f"[session handle: {kernel.handle}]")
        return tool_result(result, notes)

    def visible(ctx: ServerRequestContext[Any, Any]) -> list[Kernel]:
        mine: list[Kernel] = kernels.of(_principal(ctx))
        current: Kernel | None = _connection(ctx).state.get(_KERNEL)
        return [current, *mine] if current is not None else mine

    async def list_resources(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        return await resources.list_resources(visible(ctx))

    async def list_templates(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return resources.templates()

    async def read_resource(
        ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        return await resources.read_resource(visible(ctx), str(params.uri))

    def input_schema(name: str) -> dict[str, Any] | None:
        return next((dict(t.input_schema) for t in mcp_tools() if t.name == name), None)

    @contextlib.asynccontextmanager
    async def lifespan(server: Server[Any]) -> AsyncIterator[dict[str, Any]]:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(kernels.reap)
            try:
                yield {}
            finally:
                tasks.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await kernels.close()

    return Server(
        "kernelhub",
        version=__version__,
        instructions="Stateful, sandboxed Python: variables persist between execute_python calls."
        + HANDLE_NOTE,
        lifespan=lifespan,
        get_tool_input_schema=input_schema,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_list_resource_templates=list_templates,
        on_read_resource=read_resource,
    )


async def serve(
    url: str,
    token: str | None,
    transport: str,
    port: int,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    handle_idle_timeout: float | None = DEFAULT_HANDLE_IDLE_TIMEOUT,
    notify_interval: float = DEFAULT_NOTIFY_INTERVAL,
) -> None:
    """Serve on stdio with ``token``, or on HTTP with each client's own token."""
    async with AsyncHub(url, token or "") as hub:
        server = build_server(
            hub,
            max_chars=max_chars,
            handle_idle_timeout=handle_idle_timeout,
            notify_interval=notify_interval,
        )
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


def _seconds(value: str) -> float | None:
    """A positive number of seconds, or none/0 for no limit."""
    if value.strip().lower() in ("none", "0", ""):
        return None
    seconds = float(value)
    if seconds < 0:
        raise ValueError(value)
    return seconds


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
    parser.add_argument(
        "--handle-idle-timeout",
        type=_seconds,
        default=os.environ.get(
            "KERNELHUB_MCP_HANDLE_IDLE_TIMEOUT", str(DEFAULT_HANDLE_IDLE_TIMEOUT)
        ),
        help="seconds an unused session handle (stateless clients) lives; 0 or none: forever "
        f"(default: $KERNELHUB_MCP_HANDLE_IDLE_TIMEOUT or {DEFAULT_HANDLE_IDLE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--notify-interval",
        type=float,
        default=DEFAULT_NOTIFY_INTERVAL,
        help="least seconds between two live-output notifications of one call",
    )
    args = parser.parse_args(argv)
    url = args.url or os.environ.get("KERNELHUB_URL") or DEFAULT_URL
    token = args.token or os.environ.get("KERNELHUB_TOKEN")
    if not token and args.transport == "stdio":
        parser.error("a gateway token is required: pass --token or set KERNELHUB_TOKEN")
    asyncio.run(
        serve(
            url,
            token,
            args.transport,
            args.port,
            max_chars=args.max_chars,
            handle_idle_timeout=args.handle_idle_timeout,
            notify_interval=args.notify_interval,
        )
    )


if __name__ == "__main__":
    main()
