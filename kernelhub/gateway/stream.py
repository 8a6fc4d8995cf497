"""The WebSocket endpoint ``/v1/sessions/{id}/stream`` (protocol: ``docs/protocol.md``).

One task sends (replay from the store, then live events from the session's fan-out, most
of them written straight from the fan-out while the client keeps up), the handler itself
receives client frames. A client that stops reading is cut off with 4408
once it is ``stream_buffer_bytes`` behind; it reconnects with ``since`` and loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import TypeAdapter, ValidationError

from kernelhub import eager, jsonslices
from kernelhub.errors import (
    AuthError,
    KernelhubError,
    NotFoundError,
    QuotaError,
    SessionClosedError,
)
from kernelhub.execution.engine import ExecutionHandle
from kernelhub.gateway.auth import authenticate, check_scope, client_address, websocket_token
from kernelhub.gateway.connections import StreamRegistry
from kernelhub.gateway.errors import close_code_for, response_for, status_for
from kernelhub.gateway.ws_protocol import (
    FLUSH_NOW,
    RECEIVE_TEXT_NOW,
    SEND_FRAME_NOW,
    SEND_TEXT_NOW,
    WAIT_WRITABLE,
)
from kernelhub.models import QUIET_EVENT_TYPES
from kernelhub.replay import Replay, Verdict
from kernelhub.session.fanout import Published, Subscriber
from kernelhub.session.manager import LiveSession, SessionManager
from kernelhub.session.state import SessionState
from kernelhub.store.records import Principal, StoredExecution
from kernelhub.wire import (
    AcceptedFrame,
    ClientFrame,
    CloseCode,
    ErrorFrame,
    ExecuteFrame,
    ExecutionCreate,
    HelloFrame,
    InputReplyFrame,
    InterruptFrame,
    PauseFrame,
    PingFrame,
    PongFrame,
    ResumeFrame,
    RewindFrame,
    RewoundFrame,
    SnapshotCreatedFrame,
    SnapshotFrame,
    request_id_of,
)

log = logging.getLogger(__name__)
router = APIRouter()
_CLIENT_FRAME: TypeAdapter[ClientFrame] = TypeAdapter(ClientFrame)
_REPLAY_PAGE = 500  # events, at most
_FIRST_PAGE = 8  # then sized by replay_page
_ENDED = (SessionState.DEAD, SessionState.DELETED)
_MAX_FRAME_CHARS = 2_000_000


class _Sender:
    """Frames leave one at a time, in order: straight to the socket when nothing else is
    being sent and the socket keeps up, else through ASGI (which waits for the socket)."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.lock = asyncio.Lock()
        extensions = ws.scope.get("extensions", {})
        self.now = extensions.get(SEND_TEXT_NOW)
        self.frame_now = extensions.get(SEND_FRAME_NOW)
        self.flush_now = extensions.get(FLUSH_NOW)
        self.wait_writable = extensions.get(WAIT_WRITABLE)
        self.waiting = 0  # frames on their way through ASGI (queued on the lock included)
        self._sending: set[asyncio.Task[None]] = set()

    def try_now(self, text: str) -> bool:
        return self.now is not None and self.waiting == 0 and self.now(text)

    def try_frame_now(self, parts: list[bytes]) -> bool:
        """:meth:`try_now` for a frame already encoded, in pieces (and maybe shared with
        other clients)."""
        if self.frame_now is None:
            return self.try_now(b"".join(parts).decode())
        return self.waiting == 0 and self.frame_now(parts)

    async def send(self, text: str, *, wait: float = 0.0) -> None:
        """Send a frame; with ``wait``, it may wait that long for the frame that follows,
        to leave in the same write (see ``ws_protocol``)."""
        if not self.try_now(text):
            self.waiting += 1
            try:
                async with self.lock:
                    await self.ws.send_text(text)
            finally:
                self.waiting -= 1
        self._hold(wait)

    def send_soon(self, text: str, *, wait: float = 0.0) -> None:
        """:meth:`send` from a callback: now if the socket takes it, else from a task."""
        if self.try_now(text):
            self._hold(wait)
            return
        task = asyncio.ensure_future(self.send(text, wait=wait))
        self._sending.add(task)
        task.add_done_callback(self._sent)

    def _hold(self, wait: float) -> None:
        if wait > 0 and self.flush_now is not None:
            self.flush_now(wait)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("a frame was not sent: %s", task.exception())


@router.websocket("/v1/sessions/{session_id}/stream")
async def stream(ws: WebSocket, session_id: str) -> None:
    manager: SessionManager = ws.app.state.manager
    streams: StreamRegistry = ws.app.state.streams
    token = websocket_token(ws)
    try:
        principal = await authenticate(manager.store, token)
        assert token is not None
        check_scope(principal, act=False, session_id=session_id)
        live = await manager.live(principal, session_id)
        since = int(ws.query_params.get("since", "0"))
        if since < 0:
            raise ValueError
        opened = streams.open(principal.name, live.id, token)
    except (AuthError, QuotaError, NotFoundError, SessionClosedError, ValueError) as exc:
        # No valid token, or over a limit: refused before the handshake completes, with an
        # HTTP status and the usual JSON body. The rest (and everything, on a server
        # without the denial extension): accept, then close with an application code.
        denial = "websocket.http.response" in ws.scope.get("extensions", {})
        if denial and isinstance(exc, AuthError | QuotaError):
            await ws.send_denial_response(response_for(exc))
            return
        code, reason = _refusal(exc)
        await ws.accept()
        await ws.close(code=code, reason=reason)
        return
    try:
        await _serve(ws, manager, principal, live, since, opened.revoked)
    finally:
        streams.close(opened)


async def _serve(
    ws: WebSocket,
    manager: SessionManager,
    principal: Principal,
    live: LiveSession,
    since: int,
    revoked: asyncio.Future[None],
) -> None:
    await ws.accept()
    sender = _Sender(ws)
    budget = ws.app.state.settings.gateway.stream_buffer_bytes
    sub = live.fanout.subscribe(budget)
    frames: SharedFrames = ws.app.state.frames
    pump = asyncio.create_task(_send_events(manager, live, sub, sender, since, frames))
    try:
        receive = asyncio.create_task(_receive(ws, sender, manager, principal, live))
        waits: set[asyncio.Future[object]] = {pump, receive, revoked}  # type: ignore[arg-type]
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in (pump, receive):
            if task not in done:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        closing: tuple[int, str] | None = None
        if revoked in done:
            log.info("session %s: closing a stream whose token was revoked", live.id)
            closing = CloseCode.UNAUTHORIZED, "the token was revoked"
        elif pump in done and not pump.cancelled() and pump.exception() is not None:
            log.error("session %s: stream sender failed", live.id, exc_info=pump.exception())
        elif pump in done and not pump.cancelled():
            closing = pump.result()
        if closing is not None:
            with contextlib.suppress(Exception):
                # Generous: a stalled client gets the close frame once it reads again.
                await asyncio.wait_for(ws.close(code=closing[0], reason=closing[1]), 15.0)
    finally:
        live.fanout.unsubscribe(sub)


def _event_frame(body: str) -> str:
    """An ``EventFrame`` around an event already serialized (see ``wire.EventFrame``)."""
    return '{"type":"event","event":' + body + "}"


_FRAME_HEAD = b'{"type":"event","event":'
_FRAME_TAIL = b"}"


def event_frame_parts(body: str) -> list[bytes]:
    """:func:`_event_frame` encoded, in pieces of at most ``jsonslices.SLICE``: a big
    event's frame is never one block (8 MiB built by a concatenation and an encode were
    two fresh mmaps, ~5-10 ms of one callback; slices come from the heap, ~1 ms in all)."""
    n = jsonslices.SLICE
    if len(body) < 2 * n:
        return [_event_frame(body).encode()]
    return [_FRAME_HEAD, *(body[i : i + n].encode() for i in range(0, len(body), n)), _FRAME_TAIL]


class SharedFrames:
    """The encoded frame of the event being fanned out, made once for all its session's
    clients: the fan-out offers one event to every subscriber in turn, in one callback, so
    one slot suffices. It is let go at the end of the loop turn; what a slow client has
    not taken yet, its connection keeps by reference (``ws_protocol.send_frame_now``)."""

    def __init__(self) -> None:
        self._key: tuple[str, int] | None = None
        self._frame: list[bytes] = []
        self._drop: asyncio.Handle | None = None

    def get(self, session_id: str, item: Published) -> list[bytes]:
        if self._key != (session_id, item.seq):
            self._key = (session_id, item.seq)
            self._frame = event_frame_parts(item.body)
            if self._drop is None:
                self._drop = asyncio.get_running_loop().call_soon(self._forget)
        return self._frame

    def _forget(self) -> None:
        self._key, self._frame, self._drop = None, [], None


def _refusal(exc: Exception) -> tuple[int, str]:
    if not isinstance(exc, KernelhubError):
        return CloseCode.POLICY, "since must be a non-negative integer"
    if isinstance(exc, NotFoundError):
        reason = "no such session (or not yours)"
    elif isinstance(exc, SessionClosedError):
        reason = "the session has ended; create a new session"
    else:
        reason = str(exc)[:120]
    return close_code_for(exc), reason


async def _send_events(
    manager: SessionManager,
    live: LiveSession,
    sub: Subscriber,
    sender: _Sender,
    since: int,
    frames: SharedFrames,
) -> tuple[int, str]:
    """Replay from the store, then forward live events; returns the close code and reason.

    Live events go straight from the store commit's callback to the socket while the
    client keeps up and nothing is buffered (``Subscriber.direct``, ``ws_protocol``), and
    leave in one write as soon as the commit's events are all offered (``batch_end``);
    otherwise they are buffered and this task sends them. A client that reads slower than
    the kernel writes overflows its buffer: the buffer is dropped and the client catches up
    from the store, page by page, then goes live again — memory stays bounded and nothing
    is lost. A client that stops reading altogether is cut off once one frame waits
    ``stream_stall_timeout`` seconds (close code 4408).
    """
    stall = manager.settings.gateway.stream_stall_timeout
    window = manager.settings.gateway.coalesce_window
    replay = Replay(since)  # what was sent, and whether the store or the fan-out is next
    budget = sub.budget
    quiet = False  # the newest event sent directly may wait for company (QUIET_EVENT_TYPES)

    async def send(text: str) -> None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for costs a task per frame.
        async with asyncio.timeout(stall):
            await sender.send(text)

    async def send_event(body: str) -> None:
        # A big event straight to the socket, in pieces, when it takes it (replay waits
        # until it does): ASGI's send would concatenate, encode and frame it, three blocks.
        if len(body) < 2 * jsonslices.SLICE or not sender.try_frame_now(event_frame_parts(body)):
            await send(_event_frame(body))

    async def drained() -> None:
        # Before a page from the store (and pages sized by replay_page): a client that
        # reads nothing would otherwise hold a page (up to 500 events) of its own copies
        # while its first frame waits; 20 such clients of one 30 MB print held ~200 MiB.
        if sender.wait_writable is not None:
            async with asyncio.timeout(stall):
                await sender.wait_writable()

    def deliver(item: Published) -> bool:
        nonlocal quiet
        verdict = replay.judge(item.seq, item.prev)
        if verdict is Verdict.DUPLICATE:
            return True  # replayed already
        if verdict is Verdict.GAP or not sender.try_frame_now(frames.get(live.id, item)):
            return False  # buffered: the loop below sends it, or catches up first
        replay.delivered(item.seq)
        quiet = item.kind in QUIET_EVENT_TYPES
        return True

    def batch_end() -> None:
        # A state change waits (at most `window`) for what follows, to leave in one write:
        # on loopback each write wakes the client, and a wake-up in the middle of a cell
        # competes with the kernel for the CPU (measured: ~0.5 ms of a `1+1` round trip on
        # 2 cores). Output and finals leave now, taking whatever waits with them.
        nonlocal quiet
        assert sender.flush_now is not None
        sender.flush_now(window if quiet else 0.0)
        quiet = False

    try:
        # Subscribed first, flushed second: every event is either in the store or queued.
        await live.fanout.flush()
        last_seq = live.fanout.published_seq or await manager.store.last_seq(live.id)
        await send(HelloFrame(session_id=live.id, last_seq=last_seq).model_dump_json())
        while True:
            count = _FIRST_PAGE
            while replay.replaying:
                await drained()
                page = await manager.store.events_since(live.id, replay.last, count)
                for seq, body in replay.page(page):
                    await drained()
                    await send_event(body)
                    replay.delivered(seq)
                if page:
                    count = replay_page(count, sum(len(b) for _, b in page), budget)
            if live.phase in _ENDED:
                # Its history is replayed; nothing can come after it (docs/protocol.md).
                return CloseCode.SESSION_ENDED, f"the session has ended ({live.phase.value})"
            sub.direct = deliver if sender.now is not None else None
            sub.batch_end = batch_end if sender.flush_now is not None else None
            while (item := await sub.get()) is not None:
                verdict = replay.judge(item.seq, item.prev)
                if verdict is Verdict.GAP:
                    break
                if verdict is Verdict.DELIVER:
                    await send_event(item.body)
                    replay.delivered(item.seq)
            sub.direct = sub.batch_end = None
            if sub.closed:
                return CloseCode.SESSION_ENDED, "the session was deleted"
            # Fell behind (the buffer overflowed, or an event came before its predecessor):
            # re-arm, make the store complete up to now, catch up from it.
            replay.fell_behind()
            sub.rearm()
            await live.fanout.flush()
    except TimeoutError:
        log.warning("session %s: a stream client stopped reading; closing it with 4408", live.id)
        return CloseCode.TOO_SLOW, f"client stopped reading; reconnect with since={replay.last}"
    finally:
        sub.direct = sub.batch_end = None


def replay_page(count: int, page_bytes: int, budget: int) -> int:
    """How many events to read next from the store for a client catching up: about
    ``budget`` bytes' worth, judged by the page just sent (``count`` events,
    ``page_bytes``), at most ``_REPLAY_PAGE``. The socket looks writable until the kernel's
    buffer for it is full (megabytes on loopback), so a client that reads nothing still
    gets a page: this keeps that page near its buffer, not 500 large events."""
    if page_bytes <= 0:
        return _REPLAY_PAGE
    return max(1, min(_REPLAY_PAGE, count * budget // page_bytes))


async def _receive(
    ws: WebSocket, sender: _Sender, manager: SessionManager, principal: Principal, live: LiveSession
) -> None:
    client = client_address(ws)
    window = manager.settings.gateway.coalesce_window
    taken = ws.app.state.metrics.ws_executes
    busy = False  # a frame is being handled here: later ones queue behind it
    # An execute taken on the fast path that had to wait (its idempotency key's round
    # trip to the store, a wake-up): frames after it are handled once it is done.
    ahead: asyncio.Future[None] | None = None

    def execute_now(text: str) -> bool:
        # The frame that matters most, an `execute`, goes to the kernel as it arrives,
        # without ASGI's queue and a task switch (~0.2 ms a cell here): submit runs in
        # this very call up to its first suspension (none for an awake kernel without a
        # key). Anything else, or an execute refused at once, takes the usual path below.
        nonlocal ahead
        if busy or ahead is not None or len(text) > _MAX_FRAME_CHARS or principal.read_only:
            return False
        try:
            frame = _CLIENT_FRAME.validate_json(text)
            if not isinstance(frame, ExecuteFrame):
                return False
            body = _execution_create(frame)
        except ValidationError:
            return False
        submitted = eager.start(manager.submit(principal, live.id, body, client))
        if submitted.done() and submitted.exception() is not None:
            return False  # nothing was queued: the usual path says what went wrong
        taken.labels("fast").inc()
        if submitted.done():
            _accept(manager, sender, frame, submitted.result()[0].id, window)
            return True
        ahead = later = asyncio.ensure_future(_accept_later(submitted, sender, manager, frame))
        later.add_done_callback(arrived)
        return True

    def arrived(fut: asyncio.Future[None]) -> None:
        nonlocal ahead
        if ahead is fut:
            ahead = None
        if not fut.cancelled() and fut.exception() is not None:
            log.info("session %s: an accepted frame was not sent: %s", live.id, fut.exception())

    offer = ws.scope.get("extensions", {}).get(RECEIVE_TEXT_NOW)
    if offer is not None:
        offer(execute_now)
    try:
        while True:
            try:
                text = await ws.receive_text()
            except (WebSocketDisconnect, RuntimeError, KeyError):
                return  # the client left (binary frames are refused the same way)
            busy = True
            if (pending := ahead) is not None:  # in order: after the execute on its way
                await asyncio.wait([pending])
            request_id = None
            try:
                if len(text) > _MAX_FRAME_CHARS:
                    raise ValueError(f"frame larger than {_MAX_FRAME_CHARS} characters")
                frame = _CLIENT_FRAME.validate_json(text)
                request_id = frame.request_id
                if isinstance(frame, ExecuteFrame):
                    taken.labels("queued").inc()
                await _handle(frame, sender, manager, principal, live, client)
            except ValidationError as exc:
                request_id = request_id_of(text)
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc']) or 'frame'}: {e['msg']}"
                    for e in exc.errors()[:5]
                )
                await sender.send(
                    ErrorFrame(
                        request_id=request_id,
                        error="invalid_frame",
                        message=f"fix the frame: {problems}",
                    ).model_dump_json()
                )
            except ValueError as exc:
                await sender.send(
                    ErrorFrame(
                        request_id=request_id, error="invalid_frame", message=str(exc)
                    ).model_dump_json()
                )
            except KernelhubError as exc:
                _, code = status_for(exc)
                await sender.send(
                    ErrorFrame(
                        request_id=request_id, error=code, message=str(exc)
                    ).model_dump_json()
                )
            finally:
                busy = False
    finally:
        if offer is not None:
            offer(None)


def _accept(
    manager: SessionManager, sender: _Sender, frame: ExecuteFrame, execution_id: str, window: float
) -> None:
    """Send ``accepted`` once the execution's row is committed; like the `running` that
    comes with it, it may wait briefly for the cell's next frame."""
    text = AcceptedFrame(request_id=frame.request_id, execution_id=execution_id).model_dump_json()
    manager.when_stored(execution_id, lambda: sender.send_soon(text, wait=window))


async def _accept_later(
    submitted: asyncio.Future[tuple[StoredExecution, ExecutionHandle | None, bool]],
    sender: _Sender,
    manager: SessionManager,
    frame: ExecuteFrame,
) -> None:
    """The end of a fast-path execute that had to wait: ``accepted``, or its error."""
    try:
        row, _, _ = await submitted
    except KernelhubError as exc:
        _, code = status_for(exc)
        error = ErrorFrame(request_id=frame.request_id, error=code, message=str(exc))
        await sender.send(error.model_dump_json())
        return
    _accept(manager, sender, frame, row.id, manager.settings.gateway.coalesce_window)


def _execution_create(frame: ExecuteFrame) -> ExecutionCreate:
    return ExecutionCreate(
        code=frame.code, timeout=frame.timeout, idempotency_key=frame.idempotency_key
    )


async def _handle(
    frame: ClientFrame,
    sender: _Sender,
    manager: SessionManager,
    principal: Principal,
    live: LiveSession,
    client: str | None,
) -> None:
    if isinstance(frame, PingFrame):
        await sender.send(PongFrame(request_id=frame.request_id).model_dump_json())
        return
    check_scope(principal, act=True, session_id=live.id)  # a read-only token only watches
    if isinstance(frame, ExecuteFrame):
        row, _, _ = await manager.submit(principal, live.id, _execution_create(frame), client)
        _accept(manager, sender, frame, row.id, manager.settings.gateway.coalesce_window)
    elif isinstance(frame, InterruptFrame):
        running = live.kernel.running if live.kernel else None
        if running is None:
            raise NotFoundError("no execution is running in this session")
        await manager.interrupt(principal, running.id)
    elif isinstance(frame, InputReplyFrame):
        if principal.session_id is not None:  # a session-scoped token: that session's cells
            found = await manager.store.get_execution(frame.execution_id)
            check_scope(principal, act=True, session_id=found.session_id if found else live.id)
        await manager.send_input(principal, frame.execution_id, frame.value)
    elif isinstance(frame, SnapshotFrame):
        info = await manager.snapshot(principal, live.id, client)
        await sender.send(
            SnapshotCreatedFrame(request_id=frame.request_id, snapshot=info).model_dump_json()
        )
    elif isinstance(frame, RewindFrame):
        report = await manager.rewind(principal, live.id, frame.before_cell, client)
        await sender.send(
            RewoundFrame(request_id=frame.request_id, report=report).model_dump_json()
        )
    elif isinstance(frame, PauseFrame):
        await manager.pause(principal, live.id, client)
    elif isinstance(frame, ResumeFrame):
        await manager.resume(principal, live.id, client)
