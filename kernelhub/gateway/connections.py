"""What a client may hold open: WebSocket streams per session and principal (and whose
token they rest on, so a revocation closes them), and TCP connections with deadlines on
the request head and body.

uvicorn answers 503 past ``limit_concurrency`` only once a request's head has arrived and
times out idle keep-alive connections, but a connection that sends half a head and then
nothing holds its file descriptor forever: ~20,000 of them exhausted the gateway's
descriptors (issue 16). :class:`GuardedHttpToolsProtocol` (the default: uvicorn's
httptools parser, ~3x less CPU a request than h11's pure Python) and
:class:`GuardedH11Protocol` refuse connections past ``max_connections`` as they are made
and close those whose head or body stalls; both refuse a head larger than h11's 16 KiB
incomplete-event limit with a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kernelhub.errors import QuotaError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class OpenStream:
    """One open stream. ``revoked`` resolves when its token stops being valid."""

    principal: str
    session_id: str
    token: str
    revoked: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class StreamRegistry:
    """The open streams. The stream endpoint calls :meth:`open` before accepting a
    WebSocket (it raises :class:`QuotaError` past a limit) and :meth:`close` when it ends;
    the app's lifespan runs :meth:`watch`, which resolves ``revoked`` on every stream whose
    token the store no longer knows."""

    def __init__(self, per_session: int, per_principal: int) -> None:
        self.per_session = per_session
        self.per_principal = per_principal
        self._streams: set[OpenStream] = set()
        self._by_session: dict[str, int] = {}
        self._by_principal: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, principal: str, session_id: str, token: str) -> OpenStream:
        if self._by_session.get(session_id, 0) >= self.per_session:
            raise QuotaError(
                f"session {session_id} has {self.per_session} open streams, the limit; close "
                "one or set KERNELHUB_GATEWAY__MAX_STREAMS_PER_SESSION"
            )
        if self._by_principal.get(principal, 0) >= self.per_principal:
            raise QuotaError(
                f"principal {principal!r} has {self.per_principal} open streams, the limit; "
                "close one or set KERNELHUB_GATEWAY__MAX_STREAMS_PER_PRINCIPAL"
            )
        stream = OpenStream(principal, session_id, token)
        self._streams.add(stream)
        self._by_session[session_id] = self._by_session.get(session_id, 0) + 1
        self._by_principal[principal] = self._by_principal.get(principal, 0) + 1
        return stream

    def close(self, stream: OpenStream) -> None:
        if stream not in self._streams:
            return
        self._streams.discard(stream)
        for counts, key in (
            (self._by_session, stream.session_id),
            (self._by_principal, stream.principal),
        ):
            counts[key] -= 1
            if not counts[key]:
                del counts[key]

    async def sweep(self, valid: Callable[[str], Awaitable[bool]]) -> int:
        """Ask ``valid`` once per distinct token; resolve ``revoked`` on the streams of each
        token it says no to. Returns how many streams were revoked."""
        by_token: dict[str, list[OpenStream]] = {}
        for stream in self._streams:
            by_token.setdefault(stream.token, []).append(stream)
        revoked = 0
        for token, streams in by_token.items():
            if await valid(token):
                continue
            for stream in streams:
                if not stream.revoked.done():
                    stream.revoked.set_result(None)
                    revoked += 1
        return revoked

    async def watch(self, valid: Callable[[str], Awaitable[bool]], interval: float) -> None:
        """Sweep every ``interval`` seconds until cancelled. Tokens are revoked by another
        process (`kernelhub token revoke` writes the store), so this polls."""
        while True:
            await asyncio.sleep(interval)
            if not self._streams:
                continue
            try:
                if n := await self.sweep(valid):
                    log.info("closing %d stream(s) whose token was revoked", n)
            except Exception:
                log.exception("checking open streams' tokens failed; retrying")


def raw_response(status: int, reason: str, error: str, message: str) -> bytes:
    """A complete HTTP/1.1 error answer that closes the connection, in the gateway's JSON
    error shape, for refusals made below the ASGI app."""
    body = json.dumps({"error": error, "message": message, "detail": None}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    )
    if status in (429, 503):
        head += "retry-after: 1\r\n"
    return (head + "\r\n").encode() + body


class _Guards:
    """The rules both guarded protocols share; each says when a head or a body is awaited
    and arms the timers from its own parser's callbacks.

    - a connection made while ``max_connections`` are open gets a 503 and is closed;
    - a request head not complete ``header_timeout`` seconds after the connection was made
      (or after its first bytes, on a kept-alive connection) gets a 408 and is closed;
    - a request body that goes ``body_timeout`` seconds without a byte while the app waits
      for it is closed (a 408 if no answer has started).
    """

    max_connections = 1024
    header_timeout = 10.0
    body_timeout = 30.0

    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _detached = False  # refused, or upgraded to a WebSocket: the timers are not ours any more

    # uvicorn's protocol attributes the guards read (both protocols have them).
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: tuple[str, int] | None
    cycle: Any
    flow: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        crowded = len(self.connections) >= self.max_connections
        super().connection_made(transport)  # type: ignore[misc]  # the parser's protocol
        self._admit(crowded)

    def on_response_complete(self) -> None:
        # Idle between requests is uvicorn's keep-alive timeout; a head starts a new timer.
        self._disarm()
        super().on_response_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        """Feed ``data`` to the parser unless the connection is no longer ours; while it
        still is, the timers follow the parser's state."""
        if self._detached:
            return
        super().data_received(data)  # type: ignore[misc]
        if self._detached or self.transport.is_closing() or self._refused_head(len(data)):
            return
        self._arm()

    def _refused_head(self, received: int) -> bool:
        """Whether the parser's own limits turned the head down (h11 enforces its own)."""
        return False

    def _admit(self, crowded: bool) -> None:
        """After uvicorn's ``connection_made``: refuse if ``crowded``, else arm the head timer."""
        if crowded:
            self._detached = True
            log.warning("refusing a connection: %d are open (the limit)", self.max_connections)
            self.transport.write(
                raw_response(
                    503,
                    "Service Unavailable",
                    "too_many",
                    f"the gateway has {self.max_connections} connections open, its limit; "
                    "retry later (KERNELHUB_GATEWAY__MAX_CONNECTIONS)",
                )
            )
            self.transport.close()
            return
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _arm(self) -> None:
        """After bytes arrived and the parser took them: what the connection now waits for."""
        if self._awaiting_head():
            if self._head_timer is None:  # the first bytes of a kept-alive connection's next head
                self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)
            return
        self._cancel("_head_timer")
        self._cancel("_body_timer")
        if self._awaiting_body():
            self._body_timer = self.loop.call_later(self.body_timeout, self._body_timed_out)

    def _disarm(self) -> None:
        self._cancel("_head_timer")
        self._cancel("_body_timer")

    def _cancel(self, name: str) -> None:
        timer: asyncio.TimerHandle | None = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _awaiting_head(self) -> bool:
        raise NotImplementedError

    def _awaiting_body(self) -> bool:
        raise NotImplementedError

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return
        self._refuse(
            f"the request head did not arrive within {self.header_timeout:g} s "
            "(KERNELHUB_GATEWAY__HEADER_TIMEOUT)"
        )

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or not self._awaiting_body():
            return
        if self.flow.read_paused:  # the app is not reading yet: the wait is ours
            self._body_timer = self.loop.call_later(self.body_timeout, self._body_timed_out)
            return
        self._refuse(
            f"no request body byte arrived for {self.body_timeout:g} s "
            "(KERNELHUB_GATEWAY__BODY_TIMEOUT)"
        )

    def _refuse(self, message: str) -> None:
        log.info("closing a connection from %s: %s", self.client, message)
        cycle: Any = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(raw_response(408, "Request Timeout", "timeout", message))
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


class GuardedH11Protocol(_Guards, H11Protocol):
    """uvicorn's h11 protocol with the :class:`_Guards` rules (class attributes; make a
    configured subclass with :func:`http_protocol`)."""

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _awaiting_body(self) -> bool:
        return self.conn.their_state is h11.SEND_BODY

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._detached = True
        self._disarm()
        super().handle_websocket_upgrade(event)


class GuardedHttpToolsProtocol(_Guards, HttpToolsProtocol):
    """uvicorn's httptools (llhttp) protocol with the :class:`_Guards` rules, and h11's
    limit on a head's size, which llhttp does not have.

    httptools parses in callbacks, so the state h11 keeps is tracked here: ``_in_body``
    from a head's end to its message's end; a head is awaited when no body is and no
    request is being answered (a pipelined head waits on us, not the client: h11 does not
    time it either)."""

    max_head_bytes = 16 * 1024  # h11's DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, uvicorn's default

    _in_head = False
    _in_body = False
    _head_bytes = 0  # of an unfinished head, as h11 counts them

    def _refused_head(self, received: int) -> bool:
        if not self._in_head:
            return False
        self._head_bytes += received
        if self._head_bytes <= self.max_head_bytes:
            return False
        self.logger.warning("Invalid HTTP request received.")  # h11 refuses so, with these words
        self.send_400_response("Invalid HTTP request received.")
        return True

    def _awaiting_head(self) -> bool:
        cycle = self.cycle
        return not self._in_body and (cycle is None or cycle.response_complete)

    def _awaiting_body(self) -> bool:
        return self._in_body

    def on_message_begin(self) -> None:
        self._in_head = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._in_body = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._detached = True
        self._disarm()
        super().handle_websocket_upgrade()


def http_protocol(
    max_connections: int, header_timeout: float, body_timeout: float, parser: str = "httptools"
) -> type[GuardedHttpToolsProtocol | GuardedH11Protocol]:
    """A guarded protocol (``parser``: "httptools" or "h11") with these limits, for
    ``uvicorn.run(http=...)``."""
    base: type[GuardedHttpToolsProtocol | GuardedH11Protocol] = (
        GuardedH11Protocol if parser == "h11" else GuardedHttpToolsProtocol
    )
    return type(
        f"Configured{base.__name__.removeprefix('Guarded')}",
        (base,),
        {
            "max_connections": max_connections,
            "header_timeout": header_timeout,
            "body_timeout": body_timeout,
        },
    )


# Descriptors the gateway needs besides client connections: its store, the Docker API,
# each session's ipc sockets (5 a kernel), logs.
FD_RESERVE = 512


def connection_budget(wanted: int, soft: int, hard: int) -> tuple[int, int]:
    """(the soft descriptor limit to ask for, the connections it allows): ``wanted``
    connections plus :data:`FD_RESERVE`, as far as ``hard`` permits."""
    need = wanted + FD_RESERVE
    target = soft if soft >= need else (need if hard == resource.RLIM_INFINITY else min(need, hard))
    return target, max(8, min(wanted, target - FD_RESERVE))


def fit_descriptor_limit(wanted: int) -> int:
    """Raise this process's soft descriptor limit for ``wanted`` connections; returns the
    number of connections it allows (fewer, with a warning, if the hard limit is low)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target, allowed = connection_budget(wanted, soft, hard)
    if target != soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    allowed = max(8, min(allowed, soft - FD_RESERVE))
    if allowed < wanted:
        log.warning(
            "the descriptor limit (%d) allows %d connections, not %d "
            "(KERNELHUB_GATEWAY__MAX_CONNECTIONS); raise `ulimit -n`",
            soft, allowed, wanted,
        )  # fmt: skip
    return allowed
