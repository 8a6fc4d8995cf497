"""The Jupyter kernel WebSocket, ``/api/kernels/{id}/channels``: shell, iopub, stdin and
control over one socket, in the JSON framing or the ``v1.kernel.websocket.jupyter.org``
binary one (whichever the client offers).

The kernel behind it is a kernelhub session, shared with whoever else uses it: an
``execute_request`` becomes an execution through the session manager's submit path (so
it is recorded, audited, streamed to every client and waits its turn), and the
session's events come back from its fan-out as iopub messages (:mod:`kernelhub.jupyter.
messages`). Requests that do not run user code (kernel_info, is_complete, comm_info,
history) are answered here; complete and inspect ask the kernel silently, and only when
it is idle (a busy kernel answers them empty rather than keep an editor waiting).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from kernelhub.errors import AuthError, FrameError, KernelhubError, NotFoundError
from kernelhub.gateway.auth import authenticate, client_address, require_unscoped
from kernelhub.gateway.errors import status_for
from kernelhub.gateway.jupyter_api import jupyter_token, resolve, restart, state_of
from kernelhub.jupyter import messages
from kernelhub.jupyter.messages import Message, Origin, Translator
from kernelhub.models import ExecutionStatus
from kernelhub.session.manager import LiveSession, SessionManager
from kernelhub.store.records import Principal
from kernelhub.wire import ExecutionCreate, SessionState

log = logging.getLogger(__name__)
router = APIRouter()
_MAX_FRAME_BYTES = 2_000_000
_MIN_BUFFER_BYTES = 8 * 1024 * 1024
# Completion and inspection run in the kernel as kernelhub's own silent calls.
_CALL_TIMEOUT = 5.0
# As ipykernel completes: IPython's (provisional) completions API on the whole cell.
_COMPLETE = (
    "__import__('json').dumps((lambda pc, ip: (lambda cm: (cm.__enter__(), "
    "[[c.start, c.end, c.text] for c in ip.Completer.completions({code!r}, {pos})], "
    "cm.__exit__(None, None, None))[1])(pc()))"
    "(__import__('IPython.core.completer', fromlist=['c']).provisionalcompleter, get_ipython()))"
)
_INSPECT = (
    "__import__('json').dumps(get_ipython().object_inspect_mime("
    "__import__('IPython.utils.tokenutil', fromlist=['t']).token_at_cursor({code!r}, {pos}), "
    "detail_level={level}))"
)


@router.websocket("/api/kernels/{kernel_id}/channels")
async def channels(ws: WebSocket, kernel_id: str) -> None:
    manager: SessionManager = ws.app.state.manager
    try:
        token = jupyter_token(ws.headers.get("authorization"), ws.query_params.get("token"))
        principal = require_unscoped(
            await authenticate(ws.app.state.store, token), "Jupyter kernels API"
        )
        info = await resolve(ws.app, principal, kernel_id)
        live = await manager.live(principal, info.id)
    except KernelhubError as exc:
        await _refuse(ws, exc)
        return
    offered = ws.scope.get("subprotocols") or []
    binary = messages.V1_SUBPROTOCOL in offered
    await ws.accept(subprotocol=messages.V1_SUBPROTOCOL if binary else None)
    conn = Connection(ws, manager, principal, live, binary=binary)
    registry = state_of(ws.app).connections.setdefault(live.id, set())
    registry.add(conn)
    try:
        await conn.run()
    finally:
        registry.discard(conn)


async def _refuse(ws: WebSocket, exc: KernelhubError) -> None:
    """An HTTP answer to the handshake (401/404 as for REST) where the server can send
    one, else accept-and-close with the status as an application close code (4401, 4404)."""
    status, code = status_for(exc)
    if isinstance(exc, AuthError | NotFoundError) and "websocket.http.response" in ws.scope.get(
        "extensions", {}
    ):
        body = {"error": code, "message": str(exc)}
        await ws.send_denial_response(JSONResponse(body, status_code=status))
        return
    await ws.accept()
    await ws.close(code=4000 + status, reason=str(exc)[:120])


class Connection:
    """One client's channels socket: a task forwarding the session's events, and the
    receive loop answering the client's requests. Sends are serialized by a lock."""

    def __init__(
        self,
        ws: WebSocket,
        manager: SessionManager,
        principal: Principal,
        live: LiveSession,
        *,
        binary: bool,
    ) -> None:
        self.ws = ws
        self.manager = manager
        self.principal = principal
        self.live = live
        self.binary = binary
        self.translator = Translator()
        self.client = client_address(ws)
        self.lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    async def send(self, msg: Message) -> None:
        async with self.lock:
            if self.binary:
                await self.ws.send_bytes(messages.to_v1_frame(msg))
            else:
                await self.ws.send_text(messages.to_json_frame(msg))

    def broadcast_status(self, state: str) -> None:
        """An iopub status from outside a request (restart through REST)."""
        msg = messages.status(state, {}, self.translator.session)
        self._spawn(self.send(msg))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self) -> None:
        # A Jupyter client has no replay: a budget below the largest message (8 MiB)
        # would drop every large plot for it.
        budget = max(self.manager.settings.gateway.stream_buffer_bytes, _MIN_BUFFER_BYTES)
        sub = self.live.fanout.subscribe(budget)
        pump = asyncio.create_task(self._pump(sub))
        try:
            await self._receive()
        finally:
            pump.cancel()
            with contextlib.suppress(BaseException):
                await pump
            for task in list(self._tasks):
                task.cancel()
            self.live.fanout.unsubscribe(sub)

    async def _pump(self, sub: Any) -> None:
        """The session's events, as iopub/stdin/shell messages, as they are committed."""
        while True:
            while (item := await sub.get()) is not None:
                event = json.loads(item.body)
                flight = self.live.inflight.get(item.execution_id)
                code = flight.code if flight else None
                for msg in self.translator.translate(event, code):
                    await self.send(msg)
            if sub.closed:
                with contextlib.suppress(Exception):
                    await self.send(messages.status("dead", {}, self.translator.session))
                    await self.ws.close(code=1000, reason="the session was deleted")
                return
            # Fell further behind than the buffer allows: a Jupyter client has no replay,
            # so it misses those events; say so on iopub rather than stall the session.
            log.warning(
                "session %s: a Jupyter client fell behind; events were dropped", self.live.id
            )
            sub.rearm()

    async def _receive(self) -> None:
        while True:
            try:
                frame = await self.ws.receive()
            except (WebSocketDisconnect, RuntimeError):
                return
            if frame["type"] == "websocket.disconnect":
                return
            data = frame.get("bytes")
            text = frame.get("text")
            try:
                if data is not None:
                    if len(data) > _MAX_FRAME_BYTES:
                        raise FrameError(f"frame larger than {_MAX_FRAME_BYTES} bytes")
                    msg = messages.from_v1_frame(data)
                else:
                    if text is None or len(text) > _MAX_FRAME_BYTES:
                        raise FrameError(f"frame empty or larger than {_MAX_FRAME_BYTES} bytes")
                    msg = messages.from_json_frame(text)
            except FrameError as exc:
                log.info("session %s: a Jupyter client sent a bad frame: %s", self.live.id, exc)
                continue  # Jupyter Server drops what it cannot parse, too
            state_of(self.ws.app).touch(self.live.id)
            try:
                await self._handle(msg)
            except KernelhubError as exc:
                await self._reply_error(msg, exc)

    async def _handle(self, msg: Message) -> None:
        channel = msg["channel"]
        kind = msg["header"]["msg_type"]
        parent = msg["header"]
        content = msg["content"]
        if kind == "execute_request":
            await self._execute(msg)
        elif kind == "kernel_info_request":
            await self._answer(msg, "kernel_info_reply", messages.kernel_info_content())
        elif kind == "is_complete_request":
            body = messages.is_complete_content(str(content.get("code", "")))
            await self._answer(msg, "is_complete_reply", body)
        elif kind == "comm_info_request":
            await self._answer(msg, "comm_info_reply", {"status": "ok", "comms": {}})
        elif kind == "history_request":
            await self._answer(msg, "history_reply", {"status": "ok", "history": []})
        elif kind == "complete_request":
            await self._answer(msg, "complete_reply", await self._complete(content))
        elif kind == "inspect_request":
            await self._answer(msg, "inspect_reply", await self._inspect(content))
        elif kind == "interrupt_request":
            running = self.live.kernel.running if self.live.kernel else None
            if running is not None:
                await self.manager.interrupt(self.principal, running.id)
            await self._answer(msg, "interrupt_reply", {"status": "ok"})
        elif kind == "shutdown_request":
            # Shutting the socket's kernel down means restarting it, or nothing: the session
            # stays the principal's (DELETE /api/kernels/{id} ends it, for everyone).
            wants_restart = bool(content.get("restart"))
            if wants_restart:
                await restart(self.ws.app, self.principal, self.live, self.client)
            await self._answer(msg, "shutdown_reply", {"status": "ok", "restart": wants_restart})
        elif kind == "input_reply" and channel == "stdin":
            await self._input_reply(str(content.get("value", "")))
        elif kind.endswith("_request"):
            # Not something kernelhub offers (debugging, comms): say so, as kernels do.
            reply = {
                "status": "error",
                "ename": "NotImplementedError",
                "evalue": kind,
                "traceback": [],
            }
            await self._answer(msg, kind.replace("_request", "_reply"), reply)
        else:
            log.debug("session %s: ignoring %s on %s from %s", self.live.id, kind, channel, parent)

    async def _answer(
        self, msg: Message, reply_type: str, content: dict[str, Any], *outputs: Message
    ) -> None:
        """A reply on the request's channel, after ``outputs``, inside busy/idle as a
        kernel sends it."""
        parent, s = msg["header"], self.translator.session
        channel = "control" if msg["channel"] == "control" else "shell"
        await self.send(messages.status("busy", parent, s))
        for output in outputs:
            await self.send(output)
        await self.send(messages.message(channel, reply_type, content, parent, s))
        await self.send(messages.status("idle", parent, s))

    async def _reply_error(self, msg: Message, exc: KernelhubError) -> None:
        """A refused request (quota, a dead session) answers like a failed one."""
        kind = msg["header"]["msg_type"]
        if not kind.endswith("_request"):
            log.info("session %s: %s failed: %s", self.live.id, kind, exc)
            return
        _, code = status_for(exc)
        err = {"ename": f"kernelhub.{code}", "evalue": str(exc), "traceback": [str(exc)]}
        reply: dict[str, Any] = {"status": "error", **err}
        outputs = []
        if kind == "execute_request":
            reply["execution_count"] = self.translator.execution_count
            outputs.append(
                messages.message("iopub", "error", err, msg["header"], self.translator.session)
            )
        await self._answer(msg, kind.replace("_request", "_reply"), reply, *outputs)

    async def _execute(self, msg: Message) -> None:
        content = msg["content"]
        code = str(content.get("code", ""))
        body = ExecutionCreate(code=code)
        origin = Origin(
            parent=msg["header"],
            allow_stdin=bool(content.get("allow_stdin", True)),
            silent=bool(content.get("silent", False)),
        )
        # The origin is registered before this coroutine yields again: the execution's
        # events reach the pump only after a store commit, which cannot run in between.
        # (submit's fast case does not suspend: an awake kernel gets the cell inline.)
        row, _, _ = await self.manager.submit(self.principal, self.live.id, body, self.client)
        self.translator.sent(row.id, origin, code)

    async def _input_reply(self, value: str) -> None:
        running = self.live.kernel.running if self.live.kernel else None
        if running is None or running.status != ExecutionStatus.AWAITING_INPUT:
            log.info("session %s: an input_reply with no input() waiting", self.live.id)
            return
        await self.manager.send_input(self.principal, running.id, value)

    def _idle_kernel(self) -> Any:
        # Idle: no user cell running or queued. kernelhub's own silent call (the checkpoint
        # after each cell, on by default) shows the session busy for a moment; a call made
        # then waits its turn behind it, instead of the client getting no completions.
        kernel = self.live.kernel
        state = self.live.state
        if kernel is None or state not in (SessionState.READY, SessionState.BUSY):
            return None
        running = kernel.running
        if kernel.queue_length or (running is not None and running.internal is None):
            return None
        return kernel

    async def _call(self, expression: str) -> Any:
        kernel = self._idle_kernel()
        if kernel is None:
            return None
        try:
            answers = await kernel.call("", {"r": expression}, timeout=_CALL_TIMEOUT)
        except KernelhubError:
            return None
        answer = answers.get("r") or {}
        if answer.get("status") != "ok":
            return None
        return json.loads(ast.literal_eval(answer["data"]["text/plain"]))

    async def _complete(self, content: dict[str, Any]) -> dict[str, Any]:
        code = str(content.get("code", ""))
        pos = int(content.get("cursor_pos", len(code)))
        found = await self._call(_COMPLETE.format(code=code, pos=pos)) or []
        return {
            "status": "ok",
            "matches": [text for _, _, text in found],
            "cursor_start": found[0][0] if found else pos,
            "cursor_end": found[0][1] if found else pos,
            "metadata": {},
        }

    async def _inspect(self, content: dict[str, Any]) -> dict[str, Any]:
        code = str(content.get("code", ""))
        pos = int(content.get("cursor_pos", len(code)))
        level = 1 if content.get("detail_level") else 0
        data = await self._call(_INSPECT.format(code=code, pos=pos, level=level))
        return {"status": "ok", "found": bool(data), "data": data or {}, "metadata": {}}
