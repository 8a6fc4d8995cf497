"""One session's event stream over WebSocket, and the reading of the gateway's refusals.

:class:`_EventStream` is a collaborator of the SDK's hub and sessions: it needs of its
host only what :class:`StreamHost` names (the URL, headers, timeout and reconnect budget).
:func:`http_error` and :func:`close_error` are where an HTTP answer or a WebSocket close
becomes one of :mod:`kernelhub.client.errors`; REST uses the first too.
"""

from __future__ import annotations

import asyncio
import random
import time
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Protocol, Self

import httpx
import pydantic
from pydantic import TypeAdapter
from websockets.asyncio.client import ClientConnection, connect
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from kernelhub.client.errors import (
    CLOSE_CODES,
    ApiError,
    ClientError,
    ProtocolError,
    RateLimitedError,
    StreamLostError,
    api_error,
)
from kernelhub.replay import Replay, Verdict
from kernelhub.wire import (
    PROTOCOL_VERSION,
    AcceptedFrame,
    ErrorBody,
    ErrorFrame,
    EventFrame,
    ExecuteFrame,
    HelloFrame,
    InputReplyFrame,
    InterruptFrame,
    PingFrame,
    ServerFrame,
)

MAX_FRAME_BYTES = 64 * 2**20  # one event; images in display data can be large
MAX_RETRY_WAIT = 60.0  # a Retry-After longer than this is handed to the caller
_STABLE_CONNECTION = 10.0  # a socket that lived this long resets the reconnect budget
_SERVER_FRAME: TypeAdapter[ServerFrame] = TypeAdapter(ServerFrame)
ClientFrame = ExecuteFrame | InterruptFrame | InputReplyFrame | PingFrame


class StreamHost(Protocol):
    """What an event stream needs of the hub it belongs to."""

    timeout: float | None
    max_reconnects: int

    @property
    def headers(self) -> dict[str, str]: ...

    def ws_url(self, session_id: str, since: int) -> str: ...


def backoff(attempt: int) -> float:
    """Seconds before retry ``attempt`` (1-based): 0.25, 0.5, 1, 2, 4, 4 ... with jitter.

    Not a retry library (tenacity, backoff; considered, issue #18): what to retry (which
    statuses, ``Retry-After``, whether a request is safe to replay) is the SDK's own
    decision in ``AsyncHub._request`` and :meth:`EventStream._reconnect`; only this line
    of arithmetic would be shared, and the SDK's base install stays pydantic, httpx and
    websockets."""
    return min(0.25 * 2.0 ** (attempt - 1), 4.0) * random.uniform(0.5, 1.0)


def retry_after(headers: httpx.Headers | Headers) -> float | None:
    """``Retry-After`` in seconds: either delta-seconds or an HTTP date."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def http_error(status: int, headers: httpx.Headers | Headers, body: bytes) -> ApiError:
    """An HTTP error answer (REST, or a refused WebSocket handshake) as an exception."""
    try:
        parsed = ErrorBody.model_validate_json(body)
        error, message, detail = parsed.error, parsed.message, parsed.detail
    except pydantic.ValidationError:
        text = body.decode("utf-8", "replace").strip()[:500]
        error, message, detail = f"http_{status}", text or "no error body", None
    return api_error(status, error, message, detail, retry_after=retry_after(headers))


def close_error(exc: ConnectionClosed, session_id: str) -> ClientError | None:
    """The exception a WebSocket close stands for, or None if reconnecting may help."""
    close = exc.rcvd or exc.sent
    code = close.code if close is not None else 1006
    reason = close.reason if close is not None else ""
    if code in CLOSE_CODES:
        status, kind = CLOSE_CODES[code]
        return api_error(status, kind, f"session {session_id}: {reason or f'closed with {code}'}")
    if code in (1002, 1003, 1007, 1009, 1010):
        return ProtocolError(
            f"the event stream of session {session_id} closed with {code} ({reason or 'no reason'}): "
            f"a frame broke the protocol or exceeded {MAX_FRAME_BYTES} bytes; "
            "check that the SDK and gateway versions match"
        )
    return None


# -- the event stream ------------------------------------------------------------------


class EventStream:
    """One session's events over as many WebSocket connections as it takes.

    Calling contract: one task calls :meth:`open` (optional), then :meth:`receive`
    repeatedly, :meth:`send` in between, and :meth:`aclose` at the end (``async with``).
    :meth:`receive` returns each event frame once, in ``seq`` order, and the answers to
    requests (accepted, error, pong). When the socket drops or the gateway closes it as too
    slow (4408), it reconnects with ``since=<last seq returned>`` and drops replayed
    duplicates, so nothing is lost or repeated. Execute frames not yet answered are re-sent
    after a reconnect (they carry an idempotency key, so the gateway runs them once); other
    frames are re-sent only if they could not be written. Gives up with
    :class:`StreamLostError` after ``hub.max_reconnects`` reconnects in a row that brought
    no new event; closes that mean "no" (4401, 4404, 4410) raise their :class:`ApiError`.
    """

    def __init__(self, hub: StreamHost, session_id: str, since: int) -> None:
        self.hub = hub
        self.session_id = session_id
        self.replay = Replay(since, live=True)  # the gateway replays after each `since`
        self.first_hello_seq = since
        self._ws: ClientConnection | None = None
        self.ever_connected = False
        self._unanswered: dict[str, ExecuteFrame] = {}
        self._outbox: list[ClientFrame] = []
        self._failures = 0
        self._connected_at = 0.0
        self._last_error: BaseException | None = None

    @property
    def last_seq(self) -> int:
        """The newest event returned: the ``since`` of the next connection."""
        return self.replay.last

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()

    async def open(self) -> None:
        if self._ws is None:
            await self._reconnect()

    async def send(self, frame: ClientFrame) -> None:
        if isinstance(frame, ExecuteFrame) and frame.request_id is not None:
            self._unanswered[frame.request_id] = frame
        if self._ws is not None:
            try:
                await self._ws.send(frame.model_dump_json(exclude_none=True))
                return
            except ConnectionClosed:
                pass  # receive() sees the close and reconnects
        if not isinstance(frame, ExecuteFrame):
            self._outbox.append(frame)

    async def receive(self) -> ServerFrame:
        while True:
            if self._ws is None:
                await self._reconnect()
            assert self._ws is not None
            try:
                raw = await self._ws.recv()
            except ConnectionClosed as exc:
                self._dropped(exc)
                continue
            frame = self._parse(raw)
            if isinstance(frame, EventFrame):
                if self.replay.live(frame.event.seq) is not Verdict.DELIVER:
                    continue  # a replayed duplicate
                self._failures = 0
                return frame
            if isinstance(frame, HelloFrame):
                continue  # only the first frame of a connection is meaningful as hello
            if isinstance(frame, AcceptedFrame | ErrorFrame) and frame.request_id is not None:
                self._unanswered.pop(frame.request_id, None)
            return frame

    def _parse(self, raw: str | bytes) -> ServerFrame:
        try:
            return _SERVER_FRAME.validate_json(raw)
        except pydantic.ValidationError as exc:
            raise ProtocolError(
                f"session {self.session_id}'s stream sent a frame this SDK cannot read "
                f"({exc.errors()[:2]}): {raw[:200]!r}; check that the SDK and gateway versions match"
            ) from exc

    def _dropped(self, exc: ConnectionClosed) -> None:
        self._ws = None
        error = close_error(exc, self.session_id)
        if error is not None:
            raise error from exc
        self._last_error = exc

    async def _reconnect(self) -> None:
        if self._connected_at and time.monotonic() - self._connected_at > _STABLE_CONNECTION:
            self._failures = 0
        while True:
            self._failures += 1
            if self._failures > self.hub.max_reconnects + 1:
                raise StreamLostError(
                    f"lost the event stream of session {self.session_id}: "
                    f"{self._failures - 1} connection attempts in a row brought nothing new "
                    f"(last: {self._last_error!r}); every event up to seq {self.last_seq} was "
                    f"delivered — resume with session.events(since={self.last_seq}), or raise "
                    "Hub(max_reconnects=...)",
                    last_seq=self.last_seq,
                ) from self._last_error
            retry_after = (
                self._last_error.retry_after
                if isinstance(self._last_error, RateLimitedError)
                else None
            )
            if retry_after is not None:
                await asyncio.sleep(min(retry_after, MAX_RETRY_WAIT))
            elif self._failures > 1:
                await asyncio.sleep(backoff(self._failures - 1))
            try:
                refused = await self._connect()
            except (OSError, TimeoutError, WebSocketException) as exc:
                self._last_error = exc
                continue
            if refused is None:
                return
            self._last_error = refused

    async def _connect(self) -> ApiError | None:
        """One attempt: None once connected; a refusal worth another attempt (429,
        502-504) is returned. ``OSError``, ``TimeoutError`` or a websockets error: another
        attempt may help; any other exception ends the stream."""
        url = self.hub.ws_url(self.session_id, self.last_seq)
        try:
            ws = await connect(
                url,
                additional_headers=self.hub.headers,
                user_agent_header=None,
                open_timeout=self.hub.timeout,
                max_size=MAX_FRAME_BYTES,
            )
        except InvalidStatus as exc:
            response = exc.response
            error = http_error(response.status_code, response.headers, bytes(response.body))
            if error.status in (429, 502, 503, 504):
                error.__cause__ = exc
                return error
            raise error from exc
        try:
            async with asyncio.timeout(self.hub.timeout):
                raw = await ws.recv()
        except ConnectionClosed as exc:
            refusal = close_error(exc, self.session_id)
            if refusal is not None:
                raise refusal from exc
            raise
        except BaseException:
            await ws.close()
            raise
        hello = self._parse(raw)
        problem = None
        if not isinstance(hello, HelloFrame):
            problem = f"the first frame was {hello.type!r}, not 'hello'"
        elif hello.protocol != PROTOCOL_VERSION:
            problem = (
                f"the gateway speaks protocol {hello.protocol}, this SDK speaks "
                f"{PROTOCOL_VERSION}; install the kernelhub version that matches the gateway"
            )
        elif self.replay.lost(hello.last_seq):
            problem = (
                f"the gateway's last seq is {hello.last_seq} but this client already saw "
                f"seq {self.last_seq}; the gateway lost events (was its store reset?)"
            )
        if problem is not None:
            await ws.close()
            raise ProtocolError(f"session {self.session_id}: {problem}")
        assert isinstance(hello, HelloFrame)
        if not self.ever_connected:
            self.ever_connected = True
            self.first_hello_seq = hello.last_seq
        self._ws = ws
        self._connected_at = time.monotonic()
        pending = [*self._unanswered.values(), *self._outbox]
        self._outbox.clear()
        for frame in pending:
            await self.send(frame)
        return None
