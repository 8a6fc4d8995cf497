"""The SDK against doubles: REST through ``httpx.MockTransport``, the stream through a tiny
real WebSocket server on 127.0.0.1 (:class:`FakeGateway`) that speaks the protocol and can
drop the connection on cue. The oracle for reconnects: a cell prints consecutive numbers,
and the transcript must have no gap and no duplicate.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import io
import json
import re
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from pydantic import BaseModel, TypeAdapter
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from kernelhub.client import (
    ApiError,
    AsyncHub,
    AsyncSession,
    AuthError,
    ClientError,
    ConflictError,
    Execution,
    ForbiddenError,
    GatewayUnreachableError,
    Hub,
    InvalidRequestError,
    KernelhubError,
    MediaTypeError,
    NotFoundError,
    ProtocolError,
    RateLimitedError,
    ServerError,
    SessionEndedError,
    StorageFullError,
    StreamLostError,
    TooLargeError,
    batch_item,
)
from kernelhub.client import errors as client_errors
from kernelhub.models import (
    EndedBy,
    ErrorEvent,
    Event,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    InputRequestEvent,
    StreamEvent,
)
from kernelhub.wire import (
    AcceptedFrame,
    BatchInfo,
    BatchItemInfo,
    BatchState,
    ClientFrame,
    ErrorFrame,
    EventFrame,
    ExecuteFrame,
    ExecutionInfo,
    HelloFrame,
    InputReplyFrame,
    PingFrame,
    PongFrame,
    SessionInfo,
    SessionState,
)
from tests.conftest import UNIT

pytestmark = pytest.mark.timeout(30 * UNIT)

TOKEN = "t0ken"
SID = "s1"
NOW = datetime(2024, 1, 1, tzinfo=UTC)


def session_info(sid: str = SID, last_seq: int = 0) -> dict[str, Any]:
    return SessionInfo(
        id=sid,
        owner="alice",
        state=SessionState.READY,
        backend="local",
        created_at=NOW,
        limits={},
        metadata={},
        last_seq=last_seq,
    ).model_dump(mode="json")


def record(eid: str, status: ExecutionStatus = ExecutionStatus.COMPLETED) -> ExecutionRecord:
    return ExecutionRecord(
        execution_id=eid, status=status, ended_by=EndedBy.REPLY, queued_at=NOW, finished_at=NOW
    )


def finished_info(eid: str, events: list[Event], code: str = "") -> dict[str, Any]:
    return ExecutionInfo(
        id=eid,
        session_id=SID,
        status=ExecutionStatus.COMPLETED,
        code=code,
        created_at=NOW,
        record=record(eid),
        events=events,
    ).model_dump(mode="json")


def error_response(
    status: int, error: str, message: str = "nope", **headers: str
) -> httpx.Response:
    body = {"error": error, "message": message, "detail": {"field": "x"}}
    return httpx.Response(status, json=body, headers=headers)


class Recorder:
    """A MockTransport handler that answers from a list of routes and records requests."""

    def __init__(self, *routes: tuple[str, str, Callable[[httpx.Request], httpx.Response]]):
        self.routes = routes
        self.requests: list[httpx.Request] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        self.requests.append(request)
        for method, pattern, answer in self.routes:
            if request.method == method and re.fullmatch(pattern, request.url.path):
                return answer(request)
        return error_response(404, "not_found", f"no route {request.method} {request.url.path}")

    def bodies(self, method: str = "POST") -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.method == method and r.content]


def hub_for(handler: Recorder, **kwargs: Any) -> AsyncHub:
    return AsyncHub("http://gateway.test", TOKEN, transport=httpx.MockTransport(handler), **kwargs)


def session_route() -> tuple[str, str, Callable[[httpx.Request], httpx.Response]]:
    return "GET", f"/v1/sessions/{SID}", lambda r: httpx.Response(200, json=session_info())


# -- import safety -------------------------------------------------------------------------

BLOCKED = ("docker", "zmq", "jupyter_client", "pydantic_settings", "fastapi")


def test_client_imports_without_server_dependencies() -> None:
    script = f"""
import importlib.abc, sys
BLOCKED = {BLOCKED!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: the SDK must not need it")
        return None
sys.meta_path.insert(0, Block())
import kernelhub.client as c
hub = c.AsyncHub("http://127.0.0.1:1", "t")
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
try:
    import docker
except ImportError:
    pass
else:
    raise AssertionError("the blocker does not work")
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# -- errors ------------------------------------------------------------------------------


def test_every_client_error_shares_the_one_root() -> None:
    classes = [
        c
        for c in vars(client_errors).values()
        if isinstance(c, type)
        and issubclass(c, Exception)
        and c.__module__ == client_errors.__name__
    ]
    assert len(classes) >= 12
    assert all(issubclass(c, KernelhubError) for c in classes)
    assert all(issubclass(c, ClientError) for c in classes)


def test_client_errors_are_also_the_servers_errors_of_the_same_meaning() -> None:
    from kernelhub import errors as core

    assert issubclass(NotFoundError, core.NotFoundError)
    assert issubclass(AuthError, core.AuthError)
    assert issubclass(TooLargeError, core.TooLargeError)
    assert issubclass(TooLargeError, core.InvalidRequestError)
    assert issubclass(ConflictError, core.SessionError)
    assert issubclass(SessionEndedError, core.SessionClosedError)
    forbidden = client_errors.api_error(403, "forbidden", "admins only")
    assert isinstance(forbidden, AuthError) and forbidden.admin_required
    assert isinstance(client_errors.api_error(None, "too_many", "x"), RateLimitedError)
    assert isinstance(client_errors.api_error(None, "storage_full", "x"), StorageFullError)
    assert isinstance(client_errors.api_error(None, "invalid_frame", "x"), InvalidRequestError)
    assert type(client_errors.api_error(None, "something_new", "x")) is ApiError


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, InvalidRequestError),
        (401, AuthError),
        (403, ForbiddenError),
        (404, NotFoundError),
        (409, ConflictError),
        (410, SessionEndedError),
        (413, TooLargeError),
        (415, MediaTypeError),
        (422, InvalidRequestError),
        (429, RateLimitedError),
        (507, StorageFullError),
        (500, ServerError),
        (503, ServerError),
        (418, ApiError),
    ],
)
async def test_http_errors_map_to_one_exception_each(status: int, cls: type[ApiError]) -> None:
    handler = Recorder(("GET", "/v1/sessions", lambda r: error_response(status, "kind", "why")))
    async with hub_for(handler, max_retries=0) as hub:
        with pytest.raises(cls) as caught:
            await hub.list_sessions()
    assert type(caught.value) is cls
    assert (caught.value.status, caught.value.error, caught.value.message) == (
        status,
        "kind",
        "why",
    )
    assert caught.value.detail == {"field": "x"}
    assert cls.hint in str(caught.value)  # says what to do


async def test_error_without_a_json_body_still_maps() -> None:
    handler = Recorder(("GET", "/v1/sessions", lambda r: httpx.Response(502, text="Bad Gateway")))
    async with hub_for(handler, max_retries=0) as hub:
        with pytest.raises(ServerError) as caught:
            await hub.list_sessions()
    assert caught.value.error == "http_502" and caught.value.message == "Bad Gateway"


@pytest.mark.parametrize(
    ("header", "expected"),
    [("7", 7.0), ("1.5", 1.5), ("soon", None), (None, None)],
)
async def test_rate_limit_carries_retry_after(header: str | None, expected: float | None) -> None:
    headers = {"Retry-After": header} if header is not None else {}
    handler = Recorder(
        ("GET", "/v1/sessions", lambda r: error_response(429, "rate_limited", "slow", **headers))
    )
    async with hub_for(handler, max_retries=0) as hub:
        with pytest.raises(RateLimitedError) as caught:
            await hub.list_sessions()
    assert caught.value.retry_after == expected


async def test_retry_after_as_an_http_date() -> None:
    when = email.utils.format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
    handler = Recorder(
        (
            "GET",
            "/v1/sessions",
            lambda r: error_response(429, "rate_limited", **{"Retry-After": when}),
        )
    )
    async with hub_for(handler, max_retries=3) as hub:  # too long to wait: raised at once
        with pytest.raises(RateLimitedError) as caught:
            await hub.list_sessions()
    assert caught.value.retry_after is not None and 100 < caught.value.retry_after <= 120
    assert len(handler.requests) == 1


async def test_429_is_retried_with_the_same_idempotency_key() -> None:
    answers = iter(
        [
            error_response(429, "rate_limited", **{"Retry-After": "0"}),
            httpx.Response(200, json=finished_info("e1", [])),
        ]
    )
    handler = Recorder(
        session_route(), ("POST", r"/v1/sessions/s1/executions", lambda r: next(answers))
    )
    async with hub_for(handler) as hub:
        session = await hub.session(SID)
        execution = await session.run("1")
    assert execution.status is ExecutionStatus.COMPLETED
    keys = [b["idempotency_key"] for b in handler.bodies()]
    assert len(keys) == 2 and keys[0] == keys[1] and keys[0]


def batch_info(state: str, *, results: bool) -> dict[str, Any]:
    done = state == "finished"
    item = BatchItemInfo(
        index=0,
        status=ExecutionStatus.COMPLETED if done else ExecutionStatus.RUNNING,
        execution_id="e1",
        queued_at=NOW,
        result=ExecutionInfo.model_validate(
            finished_info("e1", [StreamEvent(execution_id="e1", seq=1, name="stdout", text="hi\n")])
        )
        if results and done
        else None,
    )
    return BatchInfo(
        id="b1", owner="alice", state=BatchState(state), created_at=NOW, concurrency=2,
        counts={item.status.value: 1}, items=[item],
    ).model_dump(mode="json")  # fmt: skip


async def test_run_batch_keys_every_item_retries_and_polls_cheaply() -> None:
    posts = iter(
        [
            error_response(429, "too_many", **{"Retry-After": "0"}),
            httpx.Response(202, json=batch_info("queued", results=False)),
        ]
    )
    states = iter(["running", "finished"])

    def get(request: httpx.Request) -> httpx.Response:
        results = request.url.params["results"] == "true"
        state = "finished" if results else next(states)
        return httpx.Response(200, json=batch_info(state, results=results))

    handler = Recorder(
        ("POST", r"/v1/batches", lambda r: next(posts)), ("GET", r"/v1/batches/b1", get)
    )
    async with hub_for(handler) as hub:
        info = await hub.run_batch(
            ["1", batch_item("2", files={"a.txt": b"\x00\xff", "b.txt": "é"}, idempotency_key="k")],
            concurrency=2,
        )
    assert info.items is not None and info.items[0].execution is not None
    assert info.items[0].execution.stdout == "hi\n"
    first, second = handler.bodies()
    assert first == second and first["concurrency"] == 2  # the retry sends the same keys
    keys = [item["idempotency_key"] for item in first["items"]]
    assert keys[1] == "k" and keys[0] and keys[0] != "k"
    files = first["items"][1]["files"]
    assert {k: base64.b64decode(v) for k, v in files.items()} == {
        "a.txt": b"\x00\xff", "b.txt": "é".encode(),
    }  # fmt: skip
    polled = [r.url.params["results"] for r in handler.requests if r.method == "GET"]
    assert polled == ["false", "false", "true"]
    with pytest.raises(InvalidRequestError):
        batch_item("1", files={"../x": b""})


def _all_subclasses(cls: type[Exception]) -> list[type[Exception]]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_all_subclasses(sub)]
    return found


@pytest.mark.parametrize("exc_type", [httpx.TransportError, *_all_subclasses(httpx.TransportError)])
async def test_every_httpx_transport_error_is_mapped(exc_type: type[httpx.TransportError]) -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise exc_type("boom", request=request)

    handler = Recorder(("POST", "/v1/sessions", fail))
    async with hub_for(handler, max_retries=0) as hub:
        with pytest.raises(GatewayUnreachableError) as caught:
            await hub.create_session()
    assert isinstance(caught.value.__cause__, exc_type)
    assert "http://gateway.test/v1/sessions" in str(caught.value)


async def test_unsent_requests_are_retried_but_maybe_sent_ones_only_when_safe() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def reset(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("reset", request=request)

    handler = Recorder(
        ("POST", "/v1/sessions", refuse),
        ("DELETE", f"/v1/sessions/{SID}", reset),
        ("GET", "/v1/executions/e1", reset),
        session_route(),
    )
    async with hub_for(handler, max_retries=1) as hub:
        with pytest.raises(GatewayUnreachableError):
            await hub.create_session()  # never reached the gateway: retried
        session = await hub.session(SID)
        with pytest.raises(GatewayUnreachableError, match="may have carried it out"):
            await session.delete()  # may have happened: not retried
        with pytest.raises(GatewayUnreachableError):
            await session.get_execution("e1")  # a read: retried
    counts = [(r.method, r.url.path) for r in handler.requests]
    assert counts.count(("POST", "/v1/sessions")) == 2
    assert counts.count(("DELETE", f"/v1/sessions/{SID}")) == 1
    assert counts.count(("GET", "/v1/executions/e1")) == 2


async def test_a_body_that_is_not_the_model_is_a_protocol_error() -> None:
    handler = Recorder(("GET", f"/v1/sessions/{SID}", lambda r: httpx.Response(200, json={"x": 1})))
    async with hub_for(handler) as hub:
        with pytest.raises(ProtocolError, match="not a SessionInfo"):
            await hub.session(SID)


def test_a_bad_base_url_is_refused_at_once() -> None:
    with pytest.raises(ClientError, match="base_url"):
        AsyncHub("127.0.0.1:8000", TOKEN)


async def test_limits_are_checked_before_sending() -> None:
    handler = Recorder()
    async with hub_for(handler) as hub:
        with pytest.raises(InvalidRequestError, match="memory_bytes"):
            await hub.create_session(limits={"memory_bytes": 1})
    assert handler.requests == []


async def test_bad_arguments_are_caller_errors_not_pydantic_crashes() -> None:
    handler = Recorder(session_route())
    async with hub_for(handler) as hub:
        session = await hub.session(SID)
        with pytest.raises(InvalidRequestError, match="timeout"):
            await session.run("1", timeout=-1)
        with pytest.raises(InvalidRequestError, match="timeout"):
            await session.run("1", timeout=0, on_stdout=print)
        with pytest.raises(InvalidRequestError, match="idempotency_key"):
            await session.submit("1", idempotency_key="k" * 201)
    assert len(handler.requests) == 1  # only the session lookup


# -- REST ----------------------------------------------------------------------------------


async def test_every_request_carries_the_token() -> None:
    handler = Recorder(
        ("POST", "/v1/sessions", lambda r: httpx.Response(201, json=session_info())),
        ("GET", "/v1/sessions", lambda r: httpx.Response(200, json={"sessions": [session_info()]})),
        ("GET", "/healthz", lambda r: httpx.Response(200, json={"status": "ok"})),
        ("DELETE", f"/v1/sessions/{SID}", lambda r: httpx.Response(204)),
    )
    async with hub_for(handler) as hub:
        session = await hub.create_session(limits={"cell_timeout": 5}, metadata={"agent": "a"})
        assert [s.id for s in await hub.list_sessions()] == [SID]
        assert await hub.health() == {"status": "ok"}
        await session.delete()
    assert len(handler.requests) == 4
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in handler.requests)
    assert handler.bodies()[0] == {"limits": {"cell_timeout": 5.0}, "metadata": {"agent": "a"}}


async def test_run_waits_and_generates_a_fresh_key_per_call() -> None:
    out = StreamEvent(execution_id="e1", seq=3, name="stdout", text="2\n")
    handler = Recorder(
        session_route(),
        (
            "POST",
            r"/v1/sessions/s1/executions",
            lambda r: httpx.Response(200, json=finished_info("e1", [out])),
        ),
    )
    async with hub_for(handler) as hub:
        session = await hub.session(SID)
        first = await session.run("print(1 + 1)", timeout=5)
        await session.run("print(1 + 1)")
        await session.run("print(1 + 1)", idempotency_key="mine")
    assert first.stdout == "2\n" and first.status is ExecutionStatus.COMPLETED
    bodies = handler.bodies()
    assert all(b["wait"] is True for b in bodies)
    assert bodies[0]["timeout"] == 5 and "timeout" not in bodies[1]
    keys = [b["idempotency_key"] for b in bodies]
    assert keys[0] and keys[1] and keys[0] != keys[1] and keys[2] == "mine"


async def test_run_falls_back_to_polling_when_answered_202() -> None:
    polls = iter(["running", "running", "done"])

    def poll(request: httpx.Request) -> httpx.Response:
        if next(polls) == "done":
            return httpx.Response(200, json=finished_info("e1", []))
        running = ExecutionInfo(
            id="e1", session_id=SID, status=ExecutionStatus.RUNNING, code="", created_at=NOW
        )
        return httpx.Response(200, json=running.model_dump(mode="json"))

    queued = ExecutionInfo(
        id="e1", session_id=SID, status=ExecutionStatus.QUEUED, code="", created_at=NOW
    )
    handler = Recorder(
        session_route(),
        (
            "POST",
            r"/v1/sessions/s1/executions",
            lambda r: httpx.Response(202, json=queued.model_dump(mode="json")),
        ),
        ("GET", "/v1/executions/e1", poll),
    )
    async with hub_for(handler) as hub:
        session = await hub.session(SID)
        execution = await session.run("slow()")
        submitted = await session.submit("slow()")
    assert execution.status is ExecutionStatus.COMPLETED
    assert submitted.status is ExecutionStatus.QUEUED
    bodies = handler.bodies()
    assert bodies[0]["wait"] is True and bodies[1]["wait"] is False
    assert bodies[1]["idempotency_key"]


async def test_execution_control_routes() -> None:
    info = finished_info("e1", [])
    handler = Recorder(
        session_route(),
        ("POST", "/v1/executions/e1/interrupt", lambda r: httpx.Response(202)),
        ("POST", "/v1/executions/e1/cancel", lambda r: httpx.Response(200, json=info)),
        ("POST", "/v1/executions/e1/input", lambda r: httpx.Response(202)),
    )
    async with hub_for(handler) as hub:
        session = await hub.session(SID)
        await session.interrupt("e1")
        assert (await session.cancel("e1")).id == "e1"
        await session.send_input("e1", "Ada")
    assert handler.bodies()[-1] == {"value": "Ada"}


async def test_upload_and_download() -> None:
    stored: dict[str, bytes] = {}

    def put(request: httpx.Request) -> httpx.Response:
        path = request.url.path.split("/files/", 1)[1]
        stored[path] = request.content
        return httpx.Response(201, json={"path": path, "size": len(request.content)})

    def get(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=stored[request.url.path.split("/files/", 1)[1]])

    async def chunks() -> AsyncIterator[bytes]:
        yield b"as"
        yield b"ync"

    handler = Recorder(
        session_route(),
        ("PUT", r"/v1/sessions/s1/files/.+", put),
        ("GET", r"/v1/sessions/s1/files/.+", get),
    )
    big = bytes(range(256)) * 1000
    async with hub_for(handler) as hub:
        session = await hub.session(SID)
        assert (await session.upload("/data/a b.bin", big)).size == len(big)
        await session.upload("it.txt", chunks())
        await session.upload("file.bin", io.BytesIO(b"from a file"))
        await session.upload("gen.txt", iter([b"sy", b"nc"]))
        assert await session.download("data/a b.bin") == big
        sink = io.BytesIO()
        assert await session.download_to("it.txt", sink) == 5
        with pytest.raises(InvalidRequestError, match="file path"):
            await session.upload("/", b"")
    assert stored == {
        "data/a b.bin": big,
        "it.txt": b"async",
        "file.bin": b"from a file",
        "gen.txt": b"sync",
    }
    assert sink.getvalue() == b"async"
    assert handler.requests[1].url.raw_path == b"/v1/sessions/s1/files/data/a%20b.bin"


async def test_download_errors_are_mapped() -> None:
    handler = Recorder(session_route())
    async with hub_for(handler) as hub:
        session = await hub.session(SID)
        with pytest.raises(NotFoundError):
            await session.download_to("missing", io.BytesIO())


# -- the fake gateway ------------------------------------------------------------------------

_CLIENT_FRAME: TypeAdapter[ClientFrame] = TypeAdapter(ClientFrame)


class FakeGateway:
    """The stream half of the gateway, on its own thread and loop, plus a REST handler.

    Programs (the "code" of an execution): ``count:N`` prints 0..N-1, one event each;
    ``input:PROMPT`` asks for a line and prints ``hello <line>``; ``reject`` is refused
    with an error frame. ``drops`` maps a seq to a close code (None: abort the TCP
    connection) applied, once, right after that event was sent on a connection.
    """

    def __init__(
        self,
        *,
        drops: dict[int, int | None] | None = None,
        history: int = 0,
        close_after_hello: int | None = None,
        refuse_handshakes: list[int] | None = None,
        drop_before_accept_once: bool = False,
        delete_at: int | None = None,
        input_deadline: bool = False,
    ) -> None:
        self.input_deadline = input_deadline  # refuse replies: the deadline answered first
        self.drops = dict(drops or {})
        self.delete_at = delete_at  # after sending this seq: deleted, cut off like the gateway
        self.deleted = False
        self.close_after_hello = close_after_hello
        self.refuse_handshakes = list(refuse_handshakes or [])
        self.drop_before_accept_once = drop_before_accept_once
        self.log: list[Event] = []
        self.finished: dict[str, ExecutionRecord] = {}
        self.by_key: dict[str, str] = {}
        self.connections: list[int] = []  # the `since` of each accepted connection
        self.handshakes = 0
        self.executes = 0
        self.input_replies: list[str] = []
        self._inputs: dict[str, asyncio.Future[str]] = {}
        self._subscribers: set[asyncio.Queue[BaseModel]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        if history:
            self._record_history(history)
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10 * UNIT), "fake gateway did not start"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10 * UNIT)
        assert not self._thread.is_alive()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with serve(
            self._serve, "127.0.0.1", 0, process_request=self._handshake, ping_interval=None
        ) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop.wait()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _record_history(self, n: int) -> None:
        for i in range(n):
            self._publish(StreamEvent(execution_id="old", name="stdout", text=f"old {i}\n"))
        self._publish(FinalEvent(execution_id="old", record=record("old")))
        self.finished["old"] = record("old")

    def events_of(self, eid: str) -> list[Event]:
        return [e for e in list(self.log) if e.execution_id == eid]

    # REST: the two routes the SDK's stream path needs
    def rest(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == f"/v1/sessions/{SID}":
            return httpx.Response(200, json=session_info(last_seq=len(self.log)))
        eid = request.url.path.rsplit("/", 1)[-1]
        if eid in self.finished:
            return httpx.Response(200, json=finished_info(eid, self.events_of(eid)))
        if eid in self.by_key.values():
            running = ExecutionInfo(
                id=eid, session_id=SID, status=ExecutionStatus.RUNNING, code="", created_at=NOW
            )
            return httpx.Response(200, json=running.model_dump(mode="json"))
        return error_response(404, "not_found")

    def _handshake(self, ws: ServerConnection, request: Request) -> Response | None:
        self.handshakes += 1
        if self.refuse_handshakes:
            status = self.refuse_handshakes.pop(0)
            response = ws.respond(HTTPStatus(status), json.dumps({"error": "x", "message": "no"}))
            response.headers["Retry-After"] = "0"
            return response
        return None

    async def _serve(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        path, _, query = ws.request.path.partition("?")
        since = int(parse_qs(query)["since"][0])
        if ws.request.headers.get("Authorization") != f"Bearer {TOKEN}":
            await ws.close(4401, "bad token")
            return
        if path != f"/v1/sessions/{SID}/stream" or self.deleted:
            await ws.close(4404, "no such session")
            return
        self.connections.append(since)
        await ws.send(HelloFrame(session_id=SID, last_seq=len(self.log)).model_dump_json())
        if self.close_after_hello is not None:
            await ws.close(self.close_after_hello)
            return
        out: asyncio.Queue[BaseModel] = asyncio.Queue()
        for event in self.log:  # replay and subscribe with no await in between: no gap
            if event.seq > since:
                out.put_nowait(EventFrame(event=event))
        self._subscribers.add(out)
        sender = asyncio.create_task(self._send_loop(ws, out))
        try:
            async for raw in ws:
                self._on_frame(ws, raw, out)
        except ConnectionClosed:
            pass
        finally:
            self._subscribers.discard(out)
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)

    async def _send_loop(self, ws: ServerConnection, out: asyncio.Queue[BaseModel]) -> None:
        while True:
            frame = await out.get()
            await ws.send(frame.model_dump_json())
            if isinstance(frame, EventFrame) and frame.event.seq == self.delete_at:
                self.deleted = True
                await ws.close(4408, "too slow")  # what the real gateway does today
                return
            if isinstance(frame, EventFrame) and frame.event.seq in self.drops:
                code = self.drops.pop(frame.event.seq)
                if code is None:
                    ws.transport.abort()
                else:
                    await ws.close(code, "you are too slow")
                return

    def _on_frame(
        self, ws: ServerConnection, raw: str | bytes, out: asyncio.Queue[BaseModel]
    ) -> None:
        frame = _CLIENT_FRAME.validate_json(raw)
        if isinstance(frame, ExecuteFrame):
            self.executes += 1
            if frame.code == "reject":
                out.put_nowait(
                    ErrorFrame(request_id=frame.request_id, error="conflict", message="busy")
                )
                return
            assert frame.idempotency_key, "the SDK must always send an idempotency key"
            eid = self.by_key.get(frame.idempotency_key)
            if eid is None:
                eid = f"e{len(self.by_key) + 1}"
                self.by_key[frame.idempotency_key] = eid
                task = asyncio.create_task(self._program(eid, frame.code))
                self._tasks.add(task)
                if self.drop_before_accept_once:
                    self.drop_before_accept_once = False
                    ws.transport.abort()
                    return
            out.put_nowait(AcceptedFrame(request_id=frame.request_id, execution_id=eid))
        elif isinstance(frame, InputReplyFrame):
            self.input_replies.append(frame.value)
            if self.input_deadline:
                self._inputs[frame.execution_id].set_result("(deadline)")
                refusal = ErrorFrame(
                    request_id=frame.request_id, error="conflict", message="no cell is waiting"
                )
                out.put_nowait(refusal)
            else:
                self._inputs[frame.execution_id].set_result(frame.value)
        elif isinstance(frame, PingFrame):
            out.put_nowait(PongFrame(request_id=frame.request_id))

    def _publish(self, event: Event) -> None:
        event = event.model_copy(update={"seq": len(self.log) + 1})
        self.log.append(event)
        for out in self._subscribers:
            out.put_nowait(EventFrame(event=event))

    async def _program(self, eid: str, code: str) -> None:
        kind, _, arg = code.partition(":")
        if kind == "count":
            for i in range(int(arg)):
                self._publish(StreamEvent(execution_id=eid, name="stdout", text=f"{i}\n"))
                await asyncio.sleep(0)
        elif kind == "input":
            self._inputs[eid] = asyncio.get_running_loop().create_future()
            self._publish(InputRequestEvent(execution_id=eid, prompt=arg))
            value = await self._inputs[eid]
            self._publish(StreamEvent(execution_id=eid, name="stdout", text=f"hello {value}\n"))
        elif kind == "fail":
            self._publish(StreamEvent(execution_id=eid, name="stderr", text="oops\n"))
            self._publish(ErrorEvent(execution_id=eid, error={"name": "ValueError", "value": arg}))
        self.finished[eid] = record(eid)
        self._publish(FinalEvent(execution_id=eid, record=record(eid)))


@pytest.fixture
def gateway() -> Iterator[Callable[..., FakeGateway]]:
    made: list[FakeGateway] = []

    def make(**kwargs: Any) -> FakeGateway:
        fake = FakeGateway(**kwargs)
        fake.start()
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.stop()


@contextlib.asynccontextmanager
async def attached(fake: FakeGateway, **kwargs: Any) -> AsyncIterator[AsyncSession]:
    kwargs.setdefault("max_reconnects", 3)
    async with AsyncHub(
        fake.url, kwargs.pop("token", TOKEN), transport=httpx.MockTransport(fake.rest), **kwargs
    ) as hub:
        yield await hub.session(SID)


def numbers(n: int) -> str:
    return "".join(f"{i}\n" for i in range(n))


def assert_gap_free(events: list[Event]) -> None:
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs


# -- the stream ------------------------------------------------------------------------------


async def test_run_streams_live_and_the_final_event_ends_it(
    gateway: Callable[..., FakeGateway],
) -> None:
    fake = gateway(history=3)
    chunks: list[str] = []
    seen: list[Event] = []

    async def on_event(event: Event) -> None:  # async callbacks are awaited
        seen.append(event)

    async with attached(fake) as session:
        execution = await session.run("count:5", on_stdout=chunks.append, on_event=on_event)
        failed = await session.run("fail:bad", on_stderr=chunks.append)
    assert chunks == ["0\n", "1\n", "2\n", "3\n", "4\n", "oops\n"]
    assert execution.stdout == numbers(5) and execution.status is ExecutionStatus.COMPLETED
    assert isinstance(execution.events[-1], FinalEvent)
    assert seen == execution.events == fake.events_of("e1")
    assert failed.events[1].type == "error" and failed.stderr == "oops\n"
    assert fake.connections == [4, 10]  # each run starts at the newest seq it knows of


async def test_run_survives_drops_without_gap_or_duplicate(
    gateway: Callable[..., FakeGateway],
) -> None:
    # 4408 (too slow), then a TCP reset, then a going-away, all mid-output.
    fake = gateway(history=2, drops={30: 4408, 80: None, 150: 1001})
    chunks: list[str] = []
    async with attached(fake) as session:
        execution = await session.run("count:200", on_stdout=chunks.append)
    assert "".join(chunks) == numbers(200) == execution.stdout
    assert len(chunks) == 200
    assert_gap_free(execution.events)
    assert execution.events == fake.events_of("e1")
    assert len(fake.by_key) == 1 and fake.executes == 1  # accepted before the drops: sent once
    assert len(fake.connections) == 4
    assert fake.connections[1] == 30  # resumed right after the last event seen
    assert fake.connections[2] <= 80 and fake.connections[3] == 150


async def test_an_unanswered_execute_is_resent_and_runs_once(
    gateway: Callable[..., FakeGateway],
) -> None:
    fake = gateway(drop_before_accept_once=True)
    chunks: list[str] = []
    async with attached(fake) as session:
        execution = await session.run("count:50", on_stdout=chunks.append)
    assert "".join(chunks) == numbers(50) == execution.stdout
    assert fake.executes == 2 and len(fake.by_key) == 1  # re-sent, run once
    assert_gap_free(execution.events)


async def test_events_replay_from_since_and_resume_across_drops(
    gateway: Callable[..., FakeGateway],
) -> None:
    fake = gateway(history=40, drops={10: 4408, 25: None})
    got: list[Event] = []
    async with (
        attached(fake) as session,
        contextlib.aclosing(session.events(since=4)) as events,
    ):
        async for event in events:
            got.append(event)
            if isinstance(event, FinalEvent):
                break
    assert [e.seq for e in got] == list(range(5, 42))
    assert fake.connections[0] == 4 and fake.connections[1] == 10


async def test_events_end_when_the_session_is_deleted(
    gateway: Callable[..., FakeGateway],
) -> None:
    fake = gateway(history=5, delete_at=3)
    async with attached(fake) as session:
        seqs = [event.seq async for event in session.events()]
    assert seqs == [1, 2, 3]
    assert fake.connections == [0]  # the reconnect was refused with 4404


async def test_on_input_answers_the_prompt(gateway: Callable[..., FakeGateway]) -> None:
    fake = gateway()
    prompts: list[str] = []

    async def answer(prompt: str) -> str:
        prompts.append(prompt)
        return "Ada"

    async with attached(fake) as session:
        execution = await session.run("input:Name? ", on_input=answer)
        again = await session.run("input:Again? ", on_input=lambda p: "Bob")
    assert prompts == ["Name? "]
    assert execution.stdout == "hello Ada\n" and again.stdout == "hello Bob\n"
    assert isinstance(execution.events[0], InputRequestEvent)
    assert fake.input_replies == ["Ada", "Bob"]


async def test_a_refused_input_reply_does_not_end_the_run(
    gateway: Callable[..., FakeGateway], caplog: pytest.LogCaptureFixture
) -> None:
    fake = gateway(input_deadline=True)
    async with attached(fake) as session:
        execution = await session.run("input:Name? ", on_input=lambda prompt: "too late")
    assert execution.stdout == "hello (deadline)\n"
    assert "input reply refused: conflict" in caplog.text


async def test_an_error_frame_raises_its_exception(gateway: Callable[..., FakeGateway]) -> None:
    async with attached(gateway()) as session:
        with pytest.raises(ConflictError, match="busy"):
            await session.run("reject", on_stdout=print)


async def test_a_failing_callback_says_the_execution_keeps_running(
    gateway: Callable[..., FakeGateway],
) -> None:
    def explode(text: str) -> None:
        raise ValueError("callback broke")

    async with attached(gateway()) as session:
        with pytest.raises(ValueError, match="callback broke") as caught:
            await session.run("count:3", on_stdout=explode)
    assert "session.interrupt('e1')" in "\n".join(caught.value.__notes__)


async def test_a_reused_key_returns_the_first_execution(
    gateway: Callable[..., FakeGateway],
) -> None:
    fake = gateway()
    first: list[str] = []
    second: list[str] = []
    async with attached(fake) as session:
        one = await session.run("count:3", idempotency_key="k", on_stdout=first.append)
        two = await session.run("count:3", idempotency_key="k", on_stdout=second.append)
    assert one == two and first == second == ["0\n", "1\n", "2\n"]
    assert len(fake.by_key) == 1


async def test_the_stream_gives_up_after_bounded_reconnects(
    gateway: Callable[..., FakeGateway],
) -> None:
    fake = gateway(history=2, close_after_hello=1011)
    async with attached(fake, max_reconnects=2) as session:
        with pytest.raises(StreamLostError, match=r"since=3") as caught:
            await session.run("count:1", on_stdout=print)
    assert caught.value.last_seq == 3
    assert len(fake.connections) == 3  # the first attempt and two reconnects


@pytest.mark.parametrize(
    ("token", "sid", "cls"),
    [("wrong", SID, AuthError), (TOKEN, "gone", NotFoundError)],
)
async def test_closes_that_mean_no_are_not_retried(
    gateway: Callable[..., FakeGateway], token: str, sid: str, cls: type[ApiError]
) -> None:
    fake = gateway()
    info = SessionInfo.model_validate(session_info(sid=sid))
    async with AsyncHub(fake.url, token, max_reconnects=3) as hub:
        with pytest.raises(cls):
            await AsyncSession(hub, info).run("count:1", on_stdout=print)
    assert fake.handshakes == 1


async def test_a_refused_handshake_is_mapped_and_503_retried(
    gateway: Callable[..., FakeGateway],
) -> None:
    fake = gateway(refuse_handshakes=[503, 503])
    async with attached(fake) as session:
        execution = await session.run("count:2", on_stdout=lambda t: None)
    assert execution.stdout == numbers(2) and fake.handshakes == 3
    fake = gateway(refuse_handshakes=[403])
    async with attached(fake) as session:
        with pytest.raises(AuthError):
            await session.run("count:2", on_stdout=print)
    assert fake.handshakes == 1


def test_every_close_code_of_the_protocol_is_classified() -> None:
    from websockets.frames import Close

    from kernelhub.client._stream import close_error as _close_error
    from kernelhub.wire import CloseCode

    def close(code: int) -> ConnectionClosed:
        return ConnectionClosed(Close(code, "why"), None)

    assert isinstance(_close_error(close(CloseCode.UNAUTHORIZED), SID), AuthError)
    assert isinstance(_close_error(close(CloseCode.POLICY), SID), InvalidRequestError)
    assert isinstance(_close_error(close(CloseCode.NOT_FOUND), SID), NotFoundError)
    assert isinstance(_close_error(close(CloseCode.SESSION_ENDED), SID), SessionEndedError)
    assert isinstance(_close_error(close(1009), SID), ProtocolError)
    for retry in (CloseCode.TOO_SLOW, CloseCode.GOING_AWAY, CloseCode.NORMAL, 1006, 1011, 1012):
        assert _close_error(close(retry), SID) is None
    assert _close_error(ConnectionClosed(None, None), SID) is None  # dropped, no close frame


def test_retry_after_parses_from_websocket_headers_too() -> None:
    from kernelhub.client._stream import http_error as _http_error

    error = _http_error(
        429, Headers({"Retry-After": "3"}), b'{"error": "rate_limited", "message": "x"}'
    )
    assert isinstance(error, RateLimitedError) and error.retry_after == 3.0


# -- the sync twin -----------------------------------------------------------------------------


def sync_hub(fake: FakeGateway, **kwargs: Any) -> Hub:
    return Hub(
        fake.url, TOKEN, transport=httpx.MockTransport(fake.rest), max_reconnects=3, **kwargs
    )


def test_sync_run_over_drops_calls_back_on_the_calling_thread(
    gateway: Callable[..., FakeGateway],
) -> None:
    fake = gateway(history=1, drops={20: 4408, 60: None})
    threads: set[int] = set()
    chunks: list[str] = []

    def on_stdout(text: str) -> None:
        threads.add(threading.get_ident())
        chunks.append(text)

    with sync_hub(fake) as hub:
        session = hub.session(SID)
        execution = session.run("count:100", on_stdout=on_stdout)
        assert isinstance(execution, Execution)
        assert session.run("input:Who? ", on_input=lambda prompt: prompt.upper()).stdout == (
            "hello WHO? \n"
        )
    assert "".join(chunks) == numbers(100) == execution.stdout
    assert threads == {threading.get_ident()}
    assert_gap_free(execution.events)


def test_sync_events_iterate_and_close(gateway: Callable[..., FakeGateway]) -> None:
    fake = gateway(history=10, drops={6: None})
    with sync_hub(fake) as hub:
        session = hub.session(SID)
        with session.events(since=2) as events:
            seqs = [event.seq for event, _ in zip(events, range(8), strict=False)]
    assert seqs == list(range(3, 11))


def test_sync_errors_and_callback_exceptions_propagate(gateway: Callable[..., FakeGateway]) -> None:
    fake = gateway()

    def explode(text: str) -> None:
        raise KeyError("from the callback")

    chunks: list[str] = []
    with sync_hub(fake) as hub:
        with pytest.raises(NotFoundError):
            hub.session("nope")
        session = hub.session(SID)
        with pytest.raises(KeyError, match="from the callback"):
            session.run("count:3", on_stdout=explode)
        with pytest.raises(ConflictError):
            session.run("reject", on_stdout=print)
        # a callback may itself use the sync API: it runs on this thread, not the loop's
        info = session.run("count:1", on_stdout=lambda t: chunks.append(session.info().id))
    assert info.stdout == "0\n" and chunks == [SID]


def test_sync_close_stops_the_portal_thread() -> None:
    hub = Hub("http://127.0.0.1:9", TOKEN)
    portal = hub._portal.thread
    assert portal.is_alive()
    hub.close()  # joins the thread
    assert not portal.is_alive()
    hub.close()  # idempotent
    with pytest.raises(ClientError, match="closed"):
        hub.list_sessions()


def test_a_forgotten_hub_stops_its_thread_when_collected() -> None:
    import gc

    hub = Hub("http://127.0.0.1:9", TOKEN)
    portal = hub._portal.thread
    del hub
    gc.collect()
    portal.join(5 * UNIT)
    assert not portal.is_alive()


def test_sync_rest_shares_the_async_error_table() -> None:
    handler = Recorder(
        (
            "GET",
            "/v1/sessions",
            lambda r: error_response(429, "rate_limited", **{"Retry-After": "2"}),
        )
    )
    with (
        Hub(
            "http://gateway.test", TOKEN, transport=httpx.MockTransport(handler), max_retries=0
        ) as hub,
        pytest.raises(RateLimitedError) as caught,
    ):
        hub.list_sessions()
    assert caught.value.retry_after == 2.0


# -- lifetimes, the environment, execution ids ---------------------------------------------


def lifetime_routes() -> Recorder:
    return Recorder(
        ("POST", "/v1/sessions", lambda r: httpx.Response(201, json=session_info())),
        ("GET", "/v1/sessions", lambda r: httpx.Response(200, json={"sessions": []})),
        session_route(),
        ("DELETE", f"/v1/sessions/{SID}", lambda r: httpx.Response(204)),
    )


async def test_a_closed_hub_refuses_but_its_sessions_keep_the_pool_until_deleted() -> None:
    handler = lifetime_routes()
    async with hub_for(handler) as hub:
        session = await hub.create_session()
    assert hub.closed
    with pytest.raises(ClientError, match=r"^this Hub is closed"):
        await hub.list_sessions()
    assert (await session.info()).id == SID  # the session still works
    await session.delete()  # the last one: the pool closes with it
    assert hub._http.is_closed
    with pytest.raises(ClientError, match="this Hub is closed"):
        await session.info()
    # A hub closed with no session out closes its pool at once.
    async with hub_for(lifetime_routes()) as bare:
        pass
    assert bare._http.is_closed


async def test_a_real_refusal_is_never_masked_as_closed() -> None:
    handler = Recorder(("GET", "/v1/sessions", lambda r: error_response(401, "unauthorized")))
    with pytest.raises(AuthError) as caught:
        await hub_for(handler).list_sessions()
    assert "closed" not in str(caught.value)


def test_hub_reads_its_address_and_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KERNELHUB_URL", raising=False)
    monkeypatch.delenv("KERNELHUB_TOKEN", raising=False)
    default = AsyncHub()
    assert default.base_url == "http://127.0.0.1:8765" and "Authorization" not in default.headers
    monkeypatch.setenv("KERNELHUB_URL", "http://gw.test:9000/")
    monkeypatch.setenv("KERNELHUB_TOKEN", "from-env")
    hub = AsyncHub()
    assert (
        hub.base_url == "http://gw.test:9000" and hub.headers["Authorization"] == "Bearer from-env"
    )
    given = AsyncHub("http://other.test", "given")  # arguments win over the environment
    assert (
        given.base_url == "http://other.test" and given.headers["Authorization"] == "Bearer given"
    )
    monkeypatch.setenv("KERNELHUB_URL", "gw.test:9000")
    with pytest.raises(ClientError, match="KERNELHUB_URL must look like"):
        AsyncHub()


async def test_without_a_token_a_401_says_how_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNELHUB_TOKEN", raising=False)
    handler = Recorder(("GET", "/v1/sessions", lambda r: error_response(401, "unauthorized")))
    hub = AsyncHub("http://gateway.test", transport=httpx.MockTransport(handler))
    with pytest.raises(AuthError) as caught:
        await hub.list_sessions()
    assert "KERNELHUB_TOKEN" in "".join(caught.value.__notes__)
    assert "authorization" not in handler.requests[0].headers


def test_a_temporary_sync_hub_lives_through_its_call_and_its_sessions() -> None:
    import gc

    handler = lifetime_routes()
    transport = httpx.MockTransport(handler)
    assert Hub("http://gateway.test", TOKEN, transport=transport).list_sessions() == []
    session = Hub("http://gateway.test", TOKEN, transport=transport).create_session()
    gc.collect()
    assert session.info().id == SID  # its Hub object is gone; the session keeps it alive
    portal = session._portal.thread
    with Hub("http://gateway.test", TOKEN, transport=transport) as hub:
        kept = hub.create_session()
    with pytest.raises(ClientError, match=r"^this Hub is closed"):
        hub.list_sessions()
    assert kept.info().id == SID
    with kept, session:
        pass  # both deleted, through hubs that are closed or gone
    assert [r.method for r in handler.requests].count("DELETE") == 2
    del session, kept
    gc.collect()
    portal.join(5 * UNIT)
    assert not portal.is_alive()


async def test_on_start_gets_the_execution_id_before_any_output(
    gateway: Callable[..., FakeGateway],
) -> None:
    fake = gateway()
    order: list[str] = []
    async with attached(fake) as session:
        execution = await session.run(
            "count:2", on_start=lambda eid: order.append(f"start {eid}"), on_stdout=order.append
        )
        plain = await session.run("count:1", on_start=order.append)  # alone, it streams too
    assert order == [f"start {execution.id}", "0\n", "1\n", plain.id]
    assert execution.id == execution.record.execution_id and plain.stdout == "0\n"
