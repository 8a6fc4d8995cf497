"""The async SDK: :class:`AsyncHub` (one gateway) and :class:`AsyncSession` (one kernel).

REST goes through one ``httpx.AsyncClient`` and one request loop (:meth:`AsyncHub._request`),
which is also the one place HTTP errors become exceptions; the hub and the sessions it gave
out share that pool, and it closes when the hub is closed and none of them is left. Live
output goes over the session's WebSocket stream (:class:`~kernelhub.client._stream.EventStream`),
which reconnects on its own and resumes with ``since=<last seq seen>``, so a caller sees
every event exactly once, in order.

No background tasks: every socket and request belongs to the call that opened it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
import logging
import os
import uuid
import weakref
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
)
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
import pydantic
from pydantic import BaseModel

from kernelhub import __version__
from kernelhub.client._stream import MAX_RETRY_WAIT, EventStream, backoff, http_error
from kernelhub.client.errors import (
    ApiError,
    ClientError,
    GatewayUnreachableError,
    NotFoundError,
    ProtocolError,
    RateLimitedError,
    SessionEndedError,
    api_error,
)
from kernelhub.models import (
    DisplayEvent,
    Event,
    Execution,
    FinalEvent,
    InputRequestEvent,
    Result,
    ResultEvent,
    StreamEvent,
    result_of,
)
from kernelhub.wire import (
    AcceptedFrame,
    BatchCreate,
    BatchInfo,
    BatchItemIn,
    BatchList,
    BatchState,
    ErrorFrame,
    EventFrame,
    ExecuteFrame,
    ExecutionCreate,
    ExecutionInfo,
    InputReplyFrame,
    LimitsIn,
    RewindReport,
    SessionCreate,
    SessionInfo,
    SessionList,
    SnapshotInfo,
)

__all__ = [
    "DEFAULT_URL",
    "TOKEN_ENV",
    "URL_ENV",
    "AsyncHub",
    "AsyncSession",
    "FileInfo",
    "batch_item",
]

URL_ENV = "KERNELHUB_URL"
TOKEN_ENV = "KERNELHUB_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8765"  # the gateway's default bind (GatewaySettings.port)

M = TypeVar("M", bound=BaseModel)

TextCallback = Callable[[str], object]
"""Called with each chunk of stdout or stderr; may be async (its result is awaited)."""
EventCallback = Callable[[Event], object]
"""Called with every event of the execution, in order; may be async."""
InputCallback = Callable[[str], "str | Awaitable[str]"]
"""Called with the prompt when the cell calls ``input()``; returns the line to send."""
StartCallback = Callable[[str], object]
"""Called with the execution id once the gateway has accepted the cell; may be async."""
ResultCallback = Callable[[Result], object]
"""Called with each rich output (a display, the last expression's value); may be async."""

log = logging.getLogger(__name__)

_CHUNK_BYTES = 64 * 1024
_POLL_INTERVAL_MAX = 1.0


class FileInfo(BaseModel):
    """What ``PUT /v1/sessions/{sid}/files/{path}`` answers."""

    path: str
    size: int


class _Readable(Protocol):
    """A binary file object, sync (``open(..., 'rb')``) or async (aiofiles)."""

    def read(self, size: int, /) -> bytes | Awaitable[bytes]: ...


class _Writable(Protocol):
    def write(self, data: bytes, /) -> object: ...


UploadData = bytes | bytearray | memoryview | AsyncIterable[bytes] | Iterable[bytes] | _Readable


def hub_address(base_url: str | None, token: str | None) -> tuple[str, str | None]:
    """The gateway URL and token a hub uses: the arguments, else ``KERNELHUB_URL`` /
    ``KERNELHUB_TOKEN``, else the local default and no token (only ``health`` works then)."""
    url = base_url if base_url is not None else os.environ.get(URL_ENV) or DEFAULT_URL
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        source = "base_url" if base_url is not None else URL_ENV
        raise ClientError(f"{source} must look like http://host:port or https://host, got {url!r}")
    return url, token if token is not None else os.environ.get(TOKEN_ENV) or None


def _new_id() -> str:
    return uuid.uuid4().hex


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a user callback that may be sync or async."""
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def _parse(model: type[M], response: httpx.Response) -> M:
    try:
        return model.model_validate_json(response.content)
    except pydantic.ValidationError as exc:
        raise ProtocolError(
            f"{response.request.method} {response.request.url.path} answered {response.status_code} "
            f"with a body that is not a {model.__name__}: {exc.errors()[:3]}; "
            "check that the SDK and gateway versions match"
        ) from exc


def _build(model: type[M], **fields: Any) -> M:
    """A request body, checked before sending: a bad argument is the caller's to fix."""
    try:
        return model(**fields)
    except pydantic.ValidationError as exc:
        problems = exc.errors(include_url=False, include_input=False)
        where = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in problems)
        raise api_error(None, "invalid_request", f"{model.__name__}: {where}", problems) from exc


def batch_item(
    code: str,
    *,
    files: Mapping[str, bytes | str] | None = None,
    limits: LimitsIn | dict[str, Any] | None = None,
    timeout: float | None = None,
    idempotency_key: str | None = None,
) -> BatchItemIn:
    """One item for :meth:`AsyncHub.run_batch`: ``code`` to run in a fresh session with
    ``files`` (path in /workspace -> bytes, or text as UTF-8) written there first."""
    encoded = {
        path: base64.b64encode(data.encode() if isinstance(data, str) else data).decode()
        for path, data in (files or {}).items()
    }
    return _build(
        BatchItemIn,
        code=code,
        files=encoded,
        limits=limits or {},
        timeout=timeout,
        idempotency_key=idempotency_key,
    )


def _to_execution(info: ExecutionInfo) -> Execution:
    if info.record is None or info.events is None:
        raise ProtocolError(
            f"execution {info.id} has status {info.status} but came without its record and events"
        )
    return Execution(record=info.record, events=info.events)


# -- the hub ---------------------------------------------------------------------------


class AsyncHub:
    """One kernelhub gateway. ``async with AsyncHub(url, token) as hub: ...``

    ``AsyncHub()`` reads the gateway's address from ``KERNELHUB_URL`` (default
    ``http://127.0.0.1:8765``) and the token from ``KERNELHUB_TOKEN``.

    Sessions share the hub's connection pool and keep it alive: after :meth:`close` the
    hub itself refuses ("this Hub is closed"), but a session it gave out goes on working
    until it is deleted (leaving ``async with session:``), and only then is the pool closed.
    ``timeout`` bounds each HTTP request and WebSocket handshake in seconds (None: no
    limit); a REST ``run`` waits as long as the execution takes, which the gateway bounds
    by the cell timeout. ``max_retries`` re-sends a request that was refused with 429/503,
    or never reached the gateway, or is safe to repeat (reads, idempotent executions).
    ``max_reconnects`` is how many times in a row the event stream may reconnect without
    receiving anything new before :class:`StreamLostError`. ``transport`` is passed to
    httpx (tests use ``httpx.MockTransport``; REST only).
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: float | None = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_retries: int = 2,
        max_reconnects: int = 5,
    ) -> None:
        base_url, token = hub_address(base_url, token)
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_reconnects = max_reconnects
        self._has_token = bool(token)
        self._headers = {"User-Agent": f"kernelhub-python/{__version__}"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport
        )
        self._closed = False
        # Sessions given out and not yet deleted: each keeps the pool open after close().
        self._sessions: weakref.WeakSet[AsyncSession] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"AsyncHub({self.base_url!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Close the hub: its own methods then raise "this Hub is closed". Sessions stay
        alive on the gateway, and a session object it gave out keeps working; the HTTP
        pool closes when the last of those is deleted. Idempotent."""
        self._closed = True
        if not self._sessions:
            await self._http.aclose()

    async def _release(self, session: AsyncSession) -> None:
        """``session`` is deleted: it no longer holds the pool open."""
        self._sessions.discard(session)
        if self._closed and not self._sessions:
            await self._http.aclose()

    async def _shutdown(self) -> None:
        """Close the pool whoever still holds it (the sync Hub's last goodbye)."""
        self._closed = True
        self._sessions.clear()
        await self._http.aclose()

    def _adopt(self, info: SessionInfo) -> AsyncSession:
        session = AsyncSession(self, info)
        self._sessions.add(session)
        return session

    async def create_session(
        self,
        limits: LimitsIn | dict[str, Any] | None = None,
        metadata: dict[str, str | int | float | bool | None] | None = None,
        from_snapshot: str | None = None,
        checkpoints: str | float | None = None,
    ) -> AsyncSession:
        """Start a new kernel. ``limits`` are capped by the operator's maxima. With
        ``from_snapshot`` (one of yours) the new kernel starts with that snapshot's
        variables and files; ``session.last_info.restore`` says what came back."""
        body = _build(
            SessionCreate,
            limits=limits or {},
            metadata=metadata or {},
            from_snapshot=from_snapshot,
            **({"checkpoints": checkpoints} if checkpoints is not None else {}),
        )
        response = await self._send(
            "POST",
            "/v1/sessions",
            json=body.model_dump(mode="json", exclude_none=True, exclude_unset=True),
        )
        return self._adopt(_parse(SessionInfo, response))

    async def session(self, session_id: str) -> AsyncSession:
        """Attach to an existing session of yours."""
        response = await self._send("GET", f"/v1/sessions/{quote(session_id, safe='')}")
        return self._adopt(_parse(SessionInfo, response))

    async def list_sessions(self) -> list[SessionInfo]:
        """Your sessions (only those of this token)."""
        return _parse(SessionList, await self._send("GET", "/v1/sessions")).sessions

    async def health(self) -> dict[str, Any]:
        """``GET /healthz``: the gateway's own answer; raises if it is not healthy."""
        response = await self._send("GET", "/healthz")
        try:
            body = response.json()
        except json.JSONDecodeError:
            return {"status": response.text.strip()}
        return body if isinstance(body, dict) else {"status": body}

    # -- batches -----------------------------------------------------------------------

    async def submit_batch(
        self, items: Iterable[BatchItemIn | str], *, concurrency: int | None = None
    ) -> BatchInfo:
        """Queue a batch and return at once. Each item (a :func:`batch_item`, or just the
        code) runs in a fresh session of its own. An item without an ``idempotency_key``
        gets a fresh one, so a retried request never runs an item twice."""
        given = [batch_item(i) if isinstance(i, str) else i for i in items]
        keyed = [
            i
            if i.idempotency_key is not None
            else i.model_copy(update={"idempotency_key": _new_id()})
            for i in given
        ]
        body = _build(BatchCreate, items=keyed, concurrency=concurrency)
        response = await self._send(
            "POST",
            "/v1/batches",
            json=body.model_dump(mode="json", exclude_none=True),
            replay_safe=True,  # every item carries a key: a replay runs nothing twice
        )
        return _parse(BatchInfo, response)

    async def get_batch(self, batch_id: str, *, results: bool = True) -> BatchInfo:
        """The batch and its items; with ``results`` each finished item's execution
        (``item.execution`` gives it as an :class:`Execution`)."""
        response = await self._send(
            "GET",
            f"/v1/batches/{quote(batch_id, safe='')}?results={str(results).lower()}",
            replay_safe=True,
        )
        return _parse(BatchInfo, response)

    async def list_batches(self) -> list[BatchInfo]:
        """Your newest batches, without their items."""
        return _parse(BatchList, await self._send("GET", "/v1/batches", replay_safe=True)).batches

    async def cancel_batch(self, batch_id: str) -> BatchInfo:
        """Cancel the queued items and interrupt the running ones."""
        response = await self._send(
            "POST", f"/v1/batches/{quote(batch_id, safe='')}/cancel", replay_safe=True
        )
        return _parse(BatchInfo, response)

    async def wait_batch(self, batch_id: str) -> BatchInfo:
        """Poll until every item has finished; then the batch with all results. Cancelling
        the wait does not cancel the batch (:meth:`cancel_batch` does)."""
        delay = 0.05
        while True:
            info = await self.get_batch(batch_id, results=False)
            if info.state in (BatchState.FINISHED, BatchState.CANCELLED):
                return await self.get_batch(batch_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_INTERVAL_MAX)

    async def run_batch(
        self, items: Iterable[BatchItemIn | str], *, concurrency: int | None = None
    ) -> BatchInfo:
        """Submit a batch and wait for it: ``[item.execution for item in info.items]``.
        A failing item is data (its status and ``error``), never an exception."""
        info = await self.submit_batch(items, concurrency=concurrency)
        return await self.wait_batch(info.id)

    # -- transport ---------------------------------------------------------------------

    async def _send(self, method: str, path: str, **options: Any) -> httpx.Response:
        """A request of the hub's own (not of a session it gave out)."""
        if self._closed:
            raise ClientError(f"this Hub is closed; {method} {path} was not sent; create a new Hub")
        return await self._request(method, path, **options)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | AsyncIterable[bytes] | None = None,
        timeout: httpx.Timeout | None = None,
        replay_safe: bool = False,
        stream: bool = False,
    ) -> httpx.Response:
        """Send one request, retrying what is safe to retry; raise for any error answer.

        A request that never reached the gateway, or was refused with 429/503, is retried
        whatever it is; one that may have been carried out (a read timed out, 502/504) only
        when ``replay_safe``. A streamed body is never retried. With ``stream`` the caller
        owns the returned response and must close it.
        """
        if self._http.is_closed:
            raise ClientError(
                f"this Hub is closed and so is its connection pool; {method} {path} was not "
                "sent; create a new Hub (AsyncHub().session(id) attaches to a session again)"
            )
        retries = self.max_retries if content is None or isinstance(content, bytes) else 0
        attempt = 0
        while True:
            request = self._http.build_request(
                method,
                path,
                json=json,
                content=content,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                unsent = isinstance(
                    exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout
                )
                if attempt < retries and (unsent or replay_safe):
                    attempt += 1
                    await asyncio.sleep(backoff(attempt))
                    continue
                maybe = "" if unsent else " (the gateway may have carried it out)"
                raise GatewayUnreachableError(
                    f"{method} {self.base_url}{path} failed{maybe}: {type(exc).__name__}: {exc}; "
                    "check base_url= and that the gateway is running, or raise timeout="
                ) from exc
            if response.is_success:
                return response
            if stream:
                await response.aread()
                await response.aclose()
            error = http_error(response.status_code, response.headers, response.content)
            if error.status == 401 and not self._has_token:
                error.add_note(f"no token was given: pass token= or set {TOKEN_ENV}")
            delay = self._retry_delay(error, attempt + 1, replay_safe)
            if attempt < retries and delay is not None:
                attempt += 1
                await asyncio.sleep(delay)
                continue
            raise error

    @staticmethod
    def _retry_delay(error: ApiError, attempt: int, replay_safe: bool) -> float | None:
        """Seconds to wait before retrying after ``error``, or None not to retry."""
        if error.status in (429, 503) or (replay_safe and error.status in (502, 504)):
            after = error.retry_after if isinstance(error, RateLimitedError) else None
            if after is None:
                return backoff(attempt)
            return after if after <= MAX_RETRY_WAIT else None
        return None

    @property
    def headers(self) -> dict[str, str]:
        """What every request and WebSocket handshake carries (the token, the SDK)."""
        return self._headers

    def ws_url(self, session_id: str, since: int) -> str:
        parts = urlsplit(self.base_url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        path = f"{parts.path}/v1/sessions/{quote(session_id, safe='')}/stream"
        return urlunsplit((scheme, parts.netloc, path, f"since={since}", ""))


# -- the session -----------------------------------------------------------------------


class AsyncSession:
    """One stateful kernel. Variables live across :meth:`run` calls::

        await session.run("x = 1")
        await session.run("print(x)", on_stdout=print)

    Leaving ``async with session:`` deletes the session.
    """

    def __init__(self, hub: AsyncHub, info: SessionInfo) -> None:
        self.hub = hub
        self.last_info = info
        self._last_seq = info.last_seq

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r}, state={self.last_info.state.value!r})"

    @property
    def id(self) -> str:
        return self.last_info.id

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Delete the session; one that is already gone is fine."""
        with contextlib.suppress(NotFoundError, SessionEndedError):
            await self.delete()

    @property
    def _path(self) -> str:
        return f"/v1/sessions/{quote(self.id, safe='')}"

    def _saw(self, seq: int) -> None:
        self._last_seq = max(self._last_seq, seq)

    async def info(self) -> SessionInfo:
        """Fetch the session's current state (also kept in :attr:`last_info`)."""
        self.last_info = _parse(SessionInfo, await self.hub._request("GET", self._path))
        self._saw(self.last_info.last_seq)
        return self.last_info

    async def delete(self, *, purge: bool = False) -> None:
        """Stop the kernel and remove the session. Its history is kept for the gateway's
        retention period; ``purge`` deletes it now (and frees its storage quota)."""
        try:
            await self.hub._request("DELETE", self._path + ("?purge=true" if purge else ""))
        except (NotFoundError, SessionEndedError):
            await self.hub._release(self)
            raise
        await self.hub._release(self)

    # -- executions --------------------------------------------------------------------

    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
        on_event: EventCallback | None = None,
        on_input: InputCallback | None = None,
        on_start: StartCallback | None = None,
        on_result: ResultCallback | None = None,
        idempotency_key: str | None = None,
    ) -> Execution:
        """Run ``code`` and return the finished :class:`Execution`.

        ``timeout`` is the cell's limit in seconds (None: the session's). A failing cell is
        not an exception: look at ``execution.error``; its rich outputs are
        ``execution.results``. With any callback, output streams over the WebSocket and
        callbacks are called in order as it arrives (they may be async): ``on_start(id)``
        as soon as the gateway has accepted the cell (keep the id to :meth:`interrupt` it
        from another task or thread), ``on_result(result)`` for each display and the
        value; ``on_input(prompt)`` answers ``input()`` — without it, a cell that asks
        waits for :meth:`send_input` or its timeout. Without callbacks this is one REST
        request. A fresh idempotency key is generated unless given, so the SDK's retries
        and reconnects never run the code twice. Cancelling ``run`` or a callback raising
        stops watching, not the execution: call :meth:`interrupt`.
        """
        user_key = idempotency_key is not None
        key = idempotency_key or _new_id()
        given = (on_stdout, on_stderr, on_event, on_input, on_start, on_result)
        if any(cb is not None for cb in given):
            callbacks = _Callbacks(*given)
            return await self._run_streamed(code, timeout, key, user_key, callbacks)
        body = _build(ExecutionCreate, code=code, timeout=timeout, wait=True, idempotency_key=key)
        response = await self.hub._request(
            "POST",
            f"{self._path}/executions",
            json=body.model_dump(mode="json", exclude_none=True),
            # The gateway ends every execution by its cell timeout; only connecting is bounded.
            timeout=httpx.Timeout(self.hub.timeout, read=None),
            replay_safe=True,
        )
        info = _parse(ExecutionInfo, response)
        if info.status.is_final and info.events is not None:
            return self._finished(info)
        return await self.wait(info.id)

    async def submit(
        self, code: str, *, timeout: float | None = None, idempotency_key: str | None = None
    ) -> ExecutionInfo:
        """Queue ``code`` and return at once (status queued or running); see :meth:`wait`."""
        body = _build(
            ExecutionCreate,
            code=code,
            timeout=timeout,
            wait=False,
            idempotency_key=idempotency_key or _new_id(),
        )
        response = await self.hub._request(
            "POST",
            f"{self._path}/executions",
            json=body.model_dump(mode="json", exclude_none=True),
            replay_safe=True,
        )
        return _parse(ExecutionInfo, response)

    async def get_execution(self, execution_id: str) -> ExecutionInfo:
        """The execution's state; ``events`` is filled in once it has finished."""
        response = await self.hub._request(
            "GET", f"/v1/executions/{quote(execution_id, safe='')}", replay_safe=True
        )
        return _parse(ExecutionInfo, response)

    async def wait(self, execution_id: str) -> Execution:
        """Poll until the execution has finished, then return it."""
        delay = 0.05
        while True:
            info = await self.get_execution(execution_id)
            if info.status.is_final and info.events is not None:
                return self._finished(info)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_INTERVAL_MAX)

    async def interrupt(self, execution_id: str) -> None:
        """Send KeyboardInterrupt to a running execution; variables are kept."""
        await self.hub._request("POST", f"/v1/executions/{quote(execution_id, safe='')}/interrupt")

    async def snapshot(self) -> SnapshotInfo:
        """Capture the variables and /workspace files (inside the sandbox); returns what
        was saved and, by name with the reason, what was not."""
        response = await self.hub._request(
            "POST", f"/v1/sessions/{quote(self.id, safe='')}/snapshots"
        )
        return _parse(SnapshotInfo, response)

    async def rewind(self, before_cell: int) -> RewindReport:
        """Undo cell ``before_cell`` and everything after it (sessions created with
        ``checkpoints``): the kernel comes back as it was before that cell."""
        response = await self.hub._request(
            "POST",
            f"/v1/sessions/{quote(self.id, safe='')}/rewind",
            json={"before_cell": before_cell},
        )
        return _parse(RewindReport, response)

    async def pause(self) -> SessionInfo:
        """Freeze the whole sandbox: no CPU, the running cell shows ``paused`` and its
        timeout stops; execute/interrupt answer 409 until :meth:`resume`."""
        response = await self.hub._request("POST", f"/v1/sessions/{quote(self.id, safe='')}/pause")
        self.last_info = _parse(SessionInfo, response)
        return self.last_info

    async def resume(self) -> SessionInfo:
        """Thaw a paused session; the cell continues exactly where it stopped."""
        response = await self.hub._request("POST", f"/v1/sessions/{quote(self.id, safe='')}/resume")
        self.last_info = _parse(SessionInfo, response)
        return self.last_info

    async def cancel(self, execution_id: str) -> ExecutionInfo:
        """Drop a queued execution before it starts."""
        response = await self.hub._request(
            "POST", f"/v1/executions/{quote(execution_id, safe='')}/cancel"
        )
        return _parse(ExecutionInfo, response)

    async def send_input(self, execution_id: str, value: str) -> None:
        """Answer the ``input()`` an execution is waiting on."""
        await self.hub._request(
            "POST", f"/v1/executions/{quote(execution_id, safe='')}/input", json={"value": value}
        )

    async def notebook(self, *, html: bool = False) -> bytes:
        """The session's executions so far as a Jupyter notebook (``.ipynb`` JSON), or with
        ``html`` as one self-contained, script-free HTML page."""
        response = await self.hub._request(
            "GET", f"{self._path}/notebook?format={'html' if html else 'ipynb'}", replay_safe=True
        )
        return response.content

    async def events(self, since: int = 0) -> AsyncGenerator[Event, None]:
        """Every event of every execution in this session with ``seq > since``, then live
        ones, each exactly once and in order, across reconnects. Ends when the session is
        deleted or ends. Close it when done:
        ``async with contextlib.aclosing(session.events()) as it: async for event in it``.
        """
        async with EventStream(self.hub, self.id, since) as stream:
            while True:
                try:
                    frame = await stream.receive()
                except SessionEndedError:
                    return
                except NotFoundError:
                    if stream.ever_connected:
                        return  # it was there, and is gone: deleted
                    raise
                if isinstance(frame, EventFrame):
                    self._saw(frame.event.seq)
                    yield frame.event

    def _finished(self, info: ExecutionInfo) -> Execution:
        execution = _to_execution(info)
        if execution.events:
            self._saw(execution.events[-1].seq)
        return execution

    async def _run_streamed(
        self, code: str, timeout: float | None, key: str, user_key: bool, callbacks: _Callbacks
    ) -> Execution:
        request_id = _new_id()
        execute = _build(
            ExecuteFrame,
            type="execute",
            code=code,
            timeout=timeout,
            idempotency_key=key,
            request_id=request_id,
        )
        async with EventStream(self.hub, self.id, since=self._last_seq) as stream:
            await stream.open()
            floor = stream.first_hello_seq  # every event up to here predates this request
            await stream.send(execute)
            execution_id: str | None = None
            early: list[Event] = []  # events that arrived before we knew our execution's id
            collected: list[Event] = []
            while True:
                frame = await stream.receive()
                if isinstance(frame, EventFrame):
                    self._saw(frame.event.seq)
                    if execution_id is None:
                        if frame.event.seq > floor:
                            early.append(frame.event)
                        continue
                    batch = [frame.event] if frame.event.execution_id == execution_id else []
                elif isinstance(frame, AcceptedFrame) and frame.request_id == request_id:
                    execution_id = frame.execution_id
                    await callbacks.started(execution_id)
                    if user_key:
                        # The key may name an execution from an earlier call, whose events
                        # predate this stream: if it has finished, its record says it all.
                        info = await self.get_execution(execution_id)
                        if info.status.is_final:
                            execution = self._finished(info)
                            for event in execution.events:  # a replay: nothing to answer
                                await callbacks.dispatch(event, None, execution_id)
                            return execution
                    batch = [e for e in early if e.execution_id == execution_id]
                    early.clear()
                elif isinstance(frame, ErrorFrame) and frame.request_id == request_id:
                    raise api_error(None, frame.error, frame.message)
                elif isinstance(frame, ErrorFrame) and frame.request_id in callbacks.reply_ids:
                    # Too late (the gateway's input deadline answered first) or refused: the
                    # execution's own events tell what happened; watching goes on.
                    log.warning("input reply refused: %s: %s", frame.error, frame.message)
                    continue
                else:
                    continue
                for event in batch:
                    collected.append(event)
                    assert execution_id is not None
                    try:
                        await callbacks.dispatch(event, stream, execution_id)
                    except Exception as exc:
                        if isinstance(event, FinalEvent):
                            raise
                        exc.add_note(
                            f"execution {execution_id} keeps running; "
                            f"session.interrupt({execution_id!r}) stops it"
                        )
                        raise
                    if isinstance(event, FinalEvent):
                        if user_key:  # it may have started before this stream did
                            return self._finished(await self.get_execution(execution_id))
                        return Execution(record=event.record, events=collected)

    # -- files -------------------------------------------------------------------------

    async def upload(self, path: str, data: UploadData) -> FileInfo:
        """Write a file into the session's workspace. ``data`` is bytes, a (sync or async)
        iterable of byte chunks, or a binary file object; chunks are streamed, not buffered.
        """
        content: bytes | AsyncIterable[bytes] = (
            bytes(data) if isinstance(data, bytes | bytearray | memoryview) else _chunks(data)
        )
        response = await self.hub._request(
            "PUT", self._file_path(path), content=content, replay_safe=True
        )
        return _parse(FileInfo, response)

    async def download(self, path: str) -> bytes:
        """Read a whole file from the session's workspace into memory."""
        response = await self.hub._request("GET", self._file_path(path), replay_safe=True)
        return response.content

    async def download_to(self, path: str, file: _Writable) -> int:
        """Stream a file from the workspace into ``file`` (sync or async); returns its size."""
        response = await self.hub._request(
            "GET", self._file_path(path), replay_safe=True, stream=True
        )
        size = 0
        try:
            async for chunk in response.aiter_bytes(_CHUNK_BYTES):
                written = file.write(chunk)
                if inspect.isawaitable(written):
                    await written
                size += len(chunk)
        except httpx.TransportError as exc:
            raise GatewayUnreachableError(
                f"downloading {path!r} from session {self.id} broke off after {size} bytes: "
                f"{type(exc).__name__}: {exc}; try again"
            ) from exc
        finally:
            await response.aclose()
        return size

    def _file_path(self, path: str) -> str:
        relative = path.lstrip("/")
        if not relative:
            raise api_error(None, "invalid_request", f"a file path is required, got {path!r}")
        return f"{self._path}/files/{quote(relative, safe='/')}"


async def _chunks(data: AsyncIterable[bytes] | Iterable[bytes] | _Readable) -> AsyncIterator[bytes]:
    if hasattr(data, "read"):  # before AsyncIterable: async files iterate by line
        while True:
            got = data.read(_CHUNK_BYTES)
            chunk = await got if inspect.isawaitable(got) else got
            if not chunk:
                return
            yield bytes(chunk)
    elif isinstance(data, AsyncIterable):
        async for chunk in data:
            yield bytes(chunk)
    else:
        for chunk in data:
            yield bytes(chunk)


class _Callbacks:
    """The callbacks of one ``run``, dispatched in event order."""

    def __init__(
        self,
        on_stdout: TextCallback | None,
        on_stderr: TextCallback | None,
        on_event: EventCallback | None,
        on_input: InputCallback | None,
        on_start: StartCallback | None,
        on_result: ResultCallback | None,
    ) -> None:
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.on_event = on_event
        self.on_input = on_input
        self.on_start = on_start
        self.on_result = on_result
        self.reply_ids: set[str] = set()

    async def started(self, execution_id: str) -> None:
        if self.on_start is not None:
            await _call(self.on_start, execution_id)

    async def dispatch(self, event: Event, stream: EventStream | None, execution_id: str) -> None:
        if self.on_event is not None:
            await _call(self.on_event, event)
        if isinstance(event, ResultEvent) or (isinstance(event, DisplayEvent) and not event.update):
            if self.on_result is not None:
                await _call(self.on_result, result_of(event))
        elif isinstance(event, StreamEvent):
            callback = self.on_stdout if event.name == "stdout" else self.on_stderr
            if callback is not None:
                await _call(callback, event.text)
        elif isinstance(event, InputRequestEvent) and self.on_input is not None and stream:
            value = await _call(self.on_input, event.prompt)
            reply = _build(
                InputReplyFrame,
                type="input_reply",
                execution_id=execution_id,
                value=value,
                request_id=_new_id(),
            )
            assert reply.request_id is not None
            self.reply_ids.add(reply.request_id)
            await stream.send(reply)
