"""``create_app(settings)``: the gateway as an ASGI app. Everything is built in the lifespan
(store, backend, session manager), nothing at import."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from kernelhub import __version__
from kernelhub.config import Settings
from kernelhub.datadir import DataDirLock
from kernelhub.errors import ForbiddenError, KernelhubError
from kernelhub.gateway import (
    e2b,
    errors,
    jupyter_api,
    jupyter_channels,
    nodes,
    openapi,
    routes,
    stream,
)
from kernelhub.gateway.auth import check_origin
from kernelhub.gateway.connections import StreamRegistry
from kernelhub.gateway.errors import error_response, response_for
from kernelhub.gateway.metrics import Metrics
from kernelhub.review import routes as review
from kernelhub.sandbox.backends import make_backend
from kernelhub.session.batches import BatchObserver, BatchRunner
from kernelhub.session.manager import Observer, SessionManager
from kernelhub.store import open_store

log = logging.getLogger(__name__)


class BodyLimit:
    """Refuse JSON bodies over the limit before reading them (file routes stream instead).

    Plain ASGI: as a ``BaseHTTPMiddleware`` it cost every request a task and a memory
    stream, ~a quarter of the gateway's CPU on a REST ``1+1`` (py-spy, issue #20)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "/files/" not in scope["path"]:
            length = Headers(scope=scope).get("content-length")
            refusal = None
            if length is not None:
                try:
                    too_big = int(length) > self.limit
                except ValueError:
                    refusal = error_response(
                        400, "invalid_request", "Content-Length is not a number"
                    )
                else:
                    if too_big:
                        refusal = error_response(
                            413,
                            "too_large",
                            f"request body is {length} bytes; the limit is {self.limit} (KERNELHUB_GATEWAY__MAX_BODY_BYTES)",
                        )
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OriginGuard:
    """Refuse requests and WebSocket handshakes from browser origins other than the
    gateway's own and ``allowed`` (403 before any route runs; a handshake never gets 101)."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self.allowed = list(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = Headers(scope=scope)
            try:
                check_origin(headers.get("origin"), headers.get("host"), self.allowed)
            except ForbiddenError as exc:
                if scope["type"] == "websocket" and "websocket.http.response" not in scope.get(
                    "extensions", {}
                ):  # a server without the denial extension: refuse the handshake bare
                    await send({"type": "websocket.close", "code": 1008})
                    return
                # (Starlette's response sends a WebSocket denial in a websocket scope.)
                await response_for(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: Settings, *, data_dir_lock: DataDirLock | None = None) -> FastAPI:
    """``data_dir_lock``: the data directory's lock if the caller took it already (``serve``
    does, before anything else); otherwise the app takes it as it starts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        lock = data_dir_lock or DataDirLock.acquire(settings.data_dir)
        try:
            async with _serving(app, lock):
                yield
        finally:
            if data_dir_lock is None:
                lock.release()

    @asynccontextmanager
    async def _serving(app: FastAPI, lock: DataDirLock) -> AsyncIterator[None]:
        store = await open_store(settings)
        backend = make_backend(
            settings, instance=settings.gateway.instance, gateway_id=lock.gateway_id
        )
        try:
            backend.check_host()
        except KernelhubError:
            await backend.close()
            await store.close()
            raise
        metrics = Metrics()
        manager = SessionManager(
            settings, backend, store, Observer(on_start=metrics.on_start, on_final=metrics.on_final)
        )
        metrics.watch(manager)
        batches = BatchRunner(
            settings,
            manager,
            store,
            BatchObserver(on_wait=metrics.on_batch_wait, on_finished=metrics.on_batch_item),
        )
        metrics.watch_batches(batches)
        streams = StreamRegistry(
            settings.gateway.max_streams_per_session, settings.gateway.max_streams_per_principal
        )

        async def valid(token: str) -> bool:
            p = await store.principal_for(token)
            return p is not None and not p.expired()

        app.state.settings = settings
        app.state.streams = streams
        app.state.frames = stream.SharedFrames()
        app.state.store = store
        app.state.manager = manager
        app.state.batches = batches
        app.state.metrics = metrics
        app.state.ready = False
        revocations: asyncio.Task[None] | None = None
        reaper: asyncio.Task[None] | None = None
        lag: asyncio.Task[None] | None = None
        try:
            await manager.start()
            await batches.start()  # after the manager: it deletes leftover batch sessions
            revocations = asyncio.create_task(
                streams.watch(valid, settings.gateway.revocation_check_interval)
            )
            reaper = asyncio.create_task(e2b.reap(app))  # sandboxes past their E2B timeout
            if settings.gateway.loop_lag_interval > 0:
                lag = asyncio.create_task(metrics.watch_loop(settings.gateway.loop_lag_interval))
            app.state.ready = True
            log.info("kernelhub gateway ready on the %s backend", backend.name)
            yield
        finally:
            app.state.ready = False
            for task in (revocations, reaper, lag):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await batches.close()  # before the manager: it records and deletes running items
            await manager.close()
            await backend.close()
            await store.close()

    app = FastAPI(
        title="kernelhub",
        version=__version__,
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimit, limit=settings.gateway.max_body_bytes)
    # Inside the guard: a preflight from an origin off the list is refused there (403),
    # one from the list gets its Access-Control-* answer here. Bearer tokens, no cookies:
    # a foreign origin never rides on a review-page sign-in.
    origins = settings.gateway.allowed_origins
    app.add_middleware(
        CORSMiddleware,
        allow_origins=[] if "*" in origins else origins,
        allow_origin_regex=".*" if "*" in origins else None,
        allow_methods=["GET", "POST", "PUT", "DELETE"],
        allow_headers=["Authorization", "Content-Type", "Idempotency-Key"],
        allow_credentials=False,
        max_age=600,
    )
    app.add_middleware(OriginGuard, allowed=settings.gateway.allowed_origins)
    errors.install(app)
    openapi.install(app)
    app.include_router(routes.router)
    app.include_router(nodes.router)  # the cluster's node agents (admin)
    app.include_router(stream.router)
    e2b.install(app)
    app.include_router(jupyter_api.router)  # Jupyter Server's /api, for Jupyter's own clients
    app.include_router(jupyter_channels.router)
    review.install(app)
    return app
