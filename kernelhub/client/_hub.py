"""The async SDK's :class:`AsyncHub`: one gateway, its connection pool and its one REST
request loop (:meth:`AsyncHub._request`), which is also the one place HTTP errors become
exceptions. The hub and the sessions it gave out share that pool, and it closes when the
hub is closed and none of them is left."""

from __future__ import annotations

import asyncio
import base64
import json
import weakref
from collections.abc import AsyncIterable, Iterable, Mapping
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from kernelhub import __version__
from kernelhub.client._rest import POLL_INTERVAL_MAX, TOKEN_ENV, build, hub_address, new_id, parse
from kernelhub.client._session import AsyncSession
from kernelhub.client._stream import MAX_RETRY_WAIT, backoff, http_error
from kernelhub.client.errors import (
    ApiError,
    ClientError,
    GatewayUnreachableError,
    RateLimitedError,
)
from kernelhub.wire import (
    BatchCreate,
    BatchInfo,
    BatchItemIn,
    BatchList,
    BatchState,
    LimitsIn,
    SessionCreate,
    SessionInfo,
    SessionList,
)


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
    return build(
        BatchItemIn,
        code=code,
        files=encoded,
        limits=limits or {},
        timeout=timeout,
        idempotency_key=idempotency_key,
    )


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
        body = build(
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
        return self._adopt(parse(SessionInfo, response))

    async def session(self, session_id: str) -> AsyncSession:
        """Attach to an existing session of yours."""
        response = await self._send("GET", f"/v1/sessions/{quote(session_id, safe='')}")
        return self._adopt(parse(SessionInfo, response))

    async def list_sessions(self) -> list[SessionInfo]:
        """Your sessions (only those of this token)."""
        return parse(SessionList, await self._send("GET", "/v1/sessions")).sessions

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
            else i.model_copy(update={"idempotency_key": new_id()})
            for i in given
        ]
        body = build(BatchCreate, items=keyed, concurrency=concurrency)
        response = await self._send(
            "POST",
            "/v1/batches",
            json=body.model_dump(mode="json", exclude_none=True),
            replay_safe=True,  # every item carries a key: a replay runs nothing twice
        )
        return parse(BatchInfo, response)

    async def get_batch(self, batch_id: str, *, results: bool = True) -> BatchInfo:
        """The batch and its items; with ``results`` each finished item's execution
        (``item.execution`` gives it as an :class:`Execution`)."""
        response = await self._send(
            "GET",
            f"/v1/batches/{quote(batch_id, safe='')}?results={str(results).lower()}",
            replay_safe=True,
        )
        return parse(BatchInfo, response)

    async def list_batches(self) -> list[BatchInfo]:
        """Your newest batches, without their items."""
        return parse(BatchList, await self._send("GET", "/v1/batches", replay_safe=True)).batches

    async def cancel_batch(self, batch_id: str) -> BatchInfo:
        """Cancel the queued items and interrupt the running ones."""
        response = await self._send(
            "POST", f"/v1/batches/{quote(batch_id, safe='')}/cancel", replay_safe=True
        )
        return parse(BatchInfo, response)

    async def wait_batch(self, batch_id: str) -> BatchInfo:
        """Poll until every item has finished; then the batch with all results. Cancelling
        the wait does not cancel the batch (:meth:`cancel_batch` does)."""
        delay = 0.05
        while True:
            info = await self.get_batch(batch_id, results=False)
            if info.state in (BatchState.FINISHED, BatchState.CANCELLED):
                return await self.get_batch(batch_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_INTERVAL_MAX)

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
