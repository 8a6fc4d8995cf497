"""``kernelhub gateway``: a stateless gateway replica (issue #24).

A thin ASGI app in front of the node agents. For each request it checks the token against
the shared store (an unknown, revoked or expired one is answered 401 here, in the usual
shape), asks the :class:`~kernelhub.cluster.router.Router` which node answers it, and
forwards it there unchanged over mutual TLS (its own client certificate, the node verified
against the cluster CA), streaming bodies both ways. WebSockets (the session stream with
replay, Jupyter's kernel channels) are relayed frame by frame, both directions, with the
peer's close code; each side's buffers are bounded (websockets' ``max_queue`` and write
limit upstream, the gateway's stall watchdog downstream), so a slow reader slows its node's
sender instead of growing memory here.

It holds nothing about sessions: every request looks the session's row up. Killing a
replica loses nothing; a client reconnects to another and resumes from its last ``seq``.
``/healthz`` and ``/readyz`` are the replica's own (ready: the store answers and a node
is alive); everything else is the nodes'. A node that cannot be reached is a 503
``node_unavailable`` naming it, never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
from starlette.types import Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from kernelhub.cluster.models import NodeInfo
from kernelhub.cluster.router import Kind, Router, classify, credential
from kernelhub.config import Settings
from kernelhub.errors import (
    ConfigError,
    KernelhubError,
    NodeUnavailableError,
    TooLargeError,
)
from kernelhub.gateway.ws_protocol import SEND_TEXT_NOW

log = logging.getLogger(__name__)

# Not forwarded: they describe one hop, not the request (RFC 9110 §7.6.1).
HOP_BY_HOP = frozenset(
    [
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "proxy-connection",
    ]
)  # fmt: skip
# A WebSocket handshake's own headers, which the upstream client makes anew.
WS_HANDSHAKE = frozenset(
    [
        "host", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
        "sec-websocket-protocol", "content-length", "origin",
    ]
)  # fmt: skip
CONNECT_TIMEOUT = 5.0  # seconds to reach a node; past it the node counts as unreachable
LOCAL = frozenset(["/healthz", "/readyz"])
# Requests about every node's sessions at once: sent to each live node, answers summed.
BROADCAST = frozenset([("POST", "/v1/admin/stop-all")])


def client_context(settings: Settings) -> ssl.SSLContext:
    """TLS towards the nodes: verify them against the cluster CA, present our cert."""
    cluster = settings.cluster
    if cluster.ca_file is None or cluster.cert_file is None or cluster.key_file is None:
        raise ConfigError(
            "a gateway replica needs KERNELHUB_CLUSTER__CA_FILE, KERNELHUB_CLUSTER__CERT_FILE "
            "and KERNELHUB_CLUSTER__KEY_FILE (`kernelhub cluster certs` makes them)"
        )
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(cluster.ca_file))
    ctx.load_cert_chain(str(cluster.cert_file), str(cluster.key_file))
    return ctx


def sendable_close(code: int | None) -> int:
    """A close code that may go on the wire (1005, 1006 and 1015 only report). A node that
    vanished (1006) becomes 1012, "service restart": reconnect (to any replica)."""
    if code is None or code in (1005, 1015):
        return 1000
    if code == 1006:
        return 1012
    return code


def _headers(scope: Scope) -> list[tuple[str, str]]:
    return [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]


def _json(status: int, doc: dict[str, Any], headers: dict[str, str] | None = None) -> Message:
    return {"status": status, "body": json.dumps(doc).encode(), "headers": headers or {}}


def refusal(exc: KernelhubError, path: str) -> Message:
    """The answer to ``exc`` from the one table, in the shape of the API ``path`` is in
    (E2B's ``{"code", "message"}`` under /e2b)."""
    from kernelhub.gateway.errors import response_for, status_for

    if path.startswith("/e2b/"):
        status, _ = status_for(exc)
        return _json(status, {"code": status, "message": str(exc)})
    response = response_for(exc)
    headers = {k: v for k, v in response.headers.items() if k not in ("content-length",)}
    return {"status": response.status_code, "body": bytes(response.body), "headers": headers}


async def _answer(send: Send, answer: Message) -> None:
    body = answer["body"]
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [
        (k.encode(), v.encode())
        for k, v in answer["headers"].items()
        if k.lower() not in ("content-type", "content-length")
    ]
    await send({"type": "http.response.start", "status": answer["status"], "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ReplicaApp:
    """The replica's ASGI app; its store and clients are made in the lifespan."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.router: Router | None = None
        self.http: httpx.AsyncClient | None = None
        self.tls: ssl.SSLContext | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)

    # -- lifespan ------------------------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        from kernelhub.store import open_store

        await receive()  # lifespan.startup
        try:
            self.tls = client_context(self.settings)
            store = await open_store(self.settings)
        except (KernelhubError, OSError, ssl.SSLError) as exc:
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        self.router = Router(
            store,
            nodes_ttl=min(1.0, self.settings.cluster.heartbeat_interval),
            default_memory_bytes=self.settings.limits.memory_bytes,
        )
        self.http = httpx.AsyncClient(
            verify=self.tls,
            trust_env=False,  # never through an HTTP proxy from the environment
            timeout=httpx.Timeout(connect=CONNECT_TIMEOUT, read=None, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await self.http.aclose()
        await store.close()
        await send({"type": "lifespan.shutdown.complete"})

    # -- HTTP ----------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if path in LOCAL:
            await _answer(send, await self._own(path))
            return
        try:
            if (scope["method"], path) in BROADCAST:
                await _answer(send, await self._broadcast(scope))
            else:
                await self._forward(scope, receive, send)
        except KernelhubError as exc:
            if exc.__class__ is not TooLargeError and not isinstance(exc, NodeUnavailableError):
                log.debug("refused %s %s: %s", scope["method"], path, exc)
            await _answer(send, refusal(exc, path))

    async def _own(self, path: str) -> Message:
        if path == "/healthz":
            return _json(200, {"status": "ok", "role": "gateway-replica"})
        assert self.router is not None
        try:
            nodes = await self.router.nodes()
        except KernelhubError as exc:
            return _json(503, {"ready": False, "reason": str(exc)})
        now = datetime.now(UTC)
        alive = [n.id for n in nodes if n.alive(now)]
        return _json(200 if alive else 503, {"ready": bool(alive), "nodes": alive})

    async def _broadcast(self, scope: Scope) -> Message:
        """The emergency stop on every live node (one node stops only its own sandboxes):
        the first refusal as it is, else ``{"stopped": <the sum>}``. A node that cannot be
        reached makes it a 503 naming it, after the others have stopped theirs."""
        assert self.router is not None and self.http is not None
        raw = [(k, v) for k, v in _headers(scope) if k not in HOP_BY_HOP]
        now = datetime.now(UTC)
        nodes = [n for n in await self.router.nodes(fresh=True) if n.alive(now)]
        if not nodes:
            await self.router.any_node()  # raises, saying why
        http = self.http

        async def one(node: NodeInfo) -> httpx.Response | NodeUnavailableError:
            try:
                return await http.request(scope["method"], _url(node.address, scope), headers=raw)
            except httpx.TransportError as exc:
                return _unreachable(node, exc)

        answers = await asyncio.gather(*(one(n) for n in nodes))
        stopped = 0
        for answer in answers:
            if isinstance(answer, httpx.Response) and answer.status_code != 200:
                headers = {"www-authenticate": answer.headers.get("www-authenticate", "")}
                return {"status": answer.status_code, "body": answer.content,
                        "headers": {k: v for k, v in headers.items() if v}}  # fmt: skip
            if isinstance(answer, httpx.Response):
                stopped += int(answer.json().get("stopped", 0))
        for answer in answers:
            if isinstance(answer, NodeUnavailableError):
                raise answer
        return _json(200, {"stopped": stopped, "nodes": len(nodes)})

    async def _principal(self, headers: dict[str, str], query: str) -> Any:
        """The caller, when the request carries a token; a bad one is refused here."""
        from kernelhub.gateway.auth import authenticate

        token = credential(headers, query)
        if token is None:
            return None  # the node decides: health, the review page and OpenAPI need none
        assert self.router is not None
        return await authenticate(self.router.store, token)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.router is not None and self.http is not None
        raw = _headers(scope)
        headers = dict(raw)
        query = scope["query_string"].decode("latin-1")
        target = classify(scope["method"], scope["path"], headers)
        principal = await self._principal(headers, query)
        body = b""
        if target.kind is Kind.CREATE:  # small JSON: read it, placement may look inside
            body = await _read_body(receive, self.settings.gateway.max_body_bytes)
        node = await self.router.resolve(target, principal, body)
        has_body = "content-length" in headers or "transfer-encoding" in headers
        content: bytes | AsyncIterator[bytes] | None
        content = body if target.kind is Kind.CREATE else (_body(receive) if has_body else None)
        request_headers = [(k, v) for k, v in raw if k not in HOP_BY_HOP]
        for attempt in range(2):
            request = self.http.build_request(
                scope["method"],
                _url(node.address, scope),
                headers=request_headers,
                content=content,
            )
            try:
                response = await self.http.send(request, stream=True)
                break
            except httpx.TransportError as exc:
                self.router.suspect(node.id)
                # Only a request not bound to a session (and with nothing streamed yet) may
                # go to another node.
                if attempt or target.kind not in (Kind.CREATE, Kind.ANY):
                    raise _unreachable(node, exc) from exc
                node = await self.router.resolve(target, principal, body)
        try:
            await self._relay(response, receive, send)
        finally:
            await response.aclose()

    async def _relay(self, response: httpx.Response, receive: Receive, send: Send) -> None:
        """The node's answer to the client as it comes; a client that goes away closes the
        node's response, so the node sees the disconnect too (E2B's /execute interrupts
        its cell then)."""
        headers = [
            (k, v) for k, v in response.headers.raw if k.decode("latin-1").lower() not in HOP_BY_HOP
        ]
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )

        async def pump() -> None:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        relay, watch = asyncio.create_task(pump()), asyncio.create_task(gone())
        try:
            await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, watch):
                task.cancel()
            relayed, _ = await asyncio.gather(relay, watch, return_exceptions=True)
        if isinstance(relayed, Exception):
            # The node went away mid-body: the client's connection closes short of it.
            log.info("relay from the node ended early: %r", relayed)

    # -- WebSocket -----------------------------------------------------------------------

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.router is not None and self.tls is not None
        if (await receive())["type"] != "websocket.connect":
            return
        raw = _headers(scope)
        headers = dict(raw)
        query = scope["query_string"].decode("latin-1")
        target = classify("GET", scope["path"], headers)
        try:
            # The node refuses a bad token itself, in its stream's own way (close codes).
            principal = await self._principal(headers, query)
        except KernelhubError:
            principal = None
        try:
            node = await self.router.resolve(target, principal, b"")
            upstream = await self._dial(node, scope, raw)
        except InvalidStatus as exc:  # the node refused the handshake: its answer, as is
            r = exc.response
            await _deny(
                scope, send, r.status_code, list(r.headers.raw_items()), bytes(r.body or b"")
            )
            return
        except KernelhubError as exc:
            answer = refusal(exc, scope["path"])
            status, body = answer["status"], answer["body"]
            await _deny(scope, send, status, list(answer["headers"].items()), body)
            return
        async with upstream:
            await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
            await _splice(scope, receive, send, upstream)

    async def _dial(
        self, node: NodeInfo, scope: Scope, raw: list[tuple[str, str]]
    ) -> ClientConnection:
        uri = "wss://" + _url(node.address, scope).split("://", 1)[1]
        extra = [(k, v) for k, v in raw if k not in HOP_BY_HOP and k not in WS_HANDSHAKE]
        origin = dict(raw).get("origin")
        try:
            return await connect(
                uri,
                ssl=self.tls,
                origin=origin,  # type: ignore[arg-type]
                additional_headers=extra,
                subprotocols=scope.get("subprotocols") or None,
                compression=None,
                proxy=None,
                user_agent_header=None,
                open_timeout=CONNECT_TIMEOUT,
                max_size=None,  # the node enforces its own limits on what it sends
                max_queue=16,
                close_timeout=5,
            )
        except InvalidStatus:
            raise
        except (OSError, TimeoutError, WebSocketException) as exc:
            assert self.router is not None
            self.router.suspect(node.id)
            raise _unreachable(node, exc) from exc


async def _splice(scope: Scope, receive: Receive, send: Send, upstream: ClientConnection) -> None:
    """Frames both ways until one side closes; the other gets its close code."""
    send_now = scope.get("extensions", {}).get(SEND_TEXT_NOW)

    async def to_node() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.receive":
                text = message.get("text")
                await upstream.send(text if text is not None else message.get("bytes") or b"")
            elif message["type"] == "websocket.disconnect":
                code = sendable_close(message.get("code", 1000))
                await upstream.close(1000 if code == 1012 else code, message.get("reason") or "")
                return

    async def to_client() -> None:
        try:
            while True:
                data = await upstream.recv()
                if isinstance(data, str):
                    if send_now is None or not send_now(data):
                        await send({"type": "websocket.send", "text": data})
                else:
                    await send({"type": "websocket.send", "bytes": data})
        except ConnectionClosed:
            pass
        code = sendable_close(upstream.close_code)
        with contextlib.suppress(Exception):  # the client may have gone at the same time
            await send(
                {"type": "websocket.close", "code": code, "reason": upstream.close_reason or ""}
            )

    tasks = [asyncio.create_task(to_node()), asyncio.create_task(to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed, OSError):
                await task


async def _deny(
    scope: Scope, send: Send, status: int, headers: list[tuple[str, str]], body: bytes
) -> None:
    """Refuse a handshake with an HTTP answer where the server can send one (uvicorn's
    denial extension), else by closing it (1008; 1013 "try again later" for a 5xx)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        kept = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in headers
            if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"
        ]
        kept.append((b"content-length", str(len(body)).encode()))
        await send({"type": "websocket.http.response.start", "status": status, "headers": kept})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.close", "code": 1013 if status >= 500 else 1008})


def _url(address: str, scope: Scope) -> str:
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    query: bytes = scope["query_string"]
    tail = "?" + query.decode("latin-1") if query else ""
    return address.rstrip("/") + raw_path.decode("latin-1") + tail


def _unreachable(node: NodeInfo, exc: BaseException) -> NodeUnavailableError:
    return NodeUnavailableError(
        f"node {node.id!r} at {node.address} cannot be reached ({type(exc).__name__}: "
        f"{exc}); retry: if it stays down its sessions move to other nodes",
        node=node.id,
    )


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise NodeUnavailableError("the client went away while sending its request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLargeError(
                f"request body is over {limit} bytes (KERNELHUB_GATEWAY__MAX_BODY_BYTES)"
            )
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        yield message.get("body", b"")
        if not message.get("more_body"):
            return


def create_replica_app(settings: Settings) -> ReplicaApp:
    return ReplicaApp(settings)


def serve_replica(settings: Settings) -> int:
    """``kernelhub gateway``: serve the replica on ``gateway.host:gateway.port``."""
    from kernelhub.cli.serve import listen_socket, run_gateway, run_on_gateway_loop, server_line

    if settings.store.url is None:
        raise ConfigError(
            "a gateway replica needs the cluster's shared store: set KERNELHUB_STORE__URL "
            "(postgresql://...), the same as its node agents'"
        )
    client_context(settings)  # the TLS files, checked before anything listens
    gw = settings.gateway
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request

    async def announce() -> None:
        print(server_line(settings))
        print(f"kernelhub gateway replica on http://{gw.host}:{gw.port}", flush=True)

    with listen_socket(gw.host, gw.port) as sock:
        return run_on_gateway_loop(
            settings,
            run_gateway(settings, sock, lambda s: create_replica_app(s), announce=announce),
        )
