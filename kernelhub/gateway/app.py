"""``create_app(settings)``: the gateway as an ASGI app. Everything is built in the lifespan
(store, backend, session manager), nothing at import."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.responses import Response

from kernelhub import __version__
from kernelhub.config import Settings
from kernelhub.gateway import errors, jupyter_api, jupyter_channels, openapi, routes, stream
from kernelhub.gateway.errors import error_response
from kernelhub.gateway.metrics import Metrics
from kernelhub.sandbox.backends import make_backend
from kernelhub.session.batches import BatchObserver, BatchRunner
from kernelhub.session.manager import Observer, SessionManager
from kernelhub.store.sqlite import SqliteStore

log = logging.getLogger(__name__)


class BodyLimit(BaseHTTPMiddleware):
    """Refuse JSON bodies over the limit before reading them (file routes stream instead)."""

    def __init__(self, app: object, limit: int) -> None:
        super().__init__(app)  # type: ignore[arg-type]
        self.limit = limit

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        length = request.headers.get("content-length")
        if "/files/" not in request.url.path and length is not None:
            try:
                too_big = int(length) > self.limit
            except ValueError:
                return error_response(400, "invalid_request", "Content-Length is not a number")
            if too_big:
                return error_response(
                    413,
                    "too_large",
                    f"request body is {length} bytes; the limit is {self.limit} (KERNELHUB_GATEWAY__MAX_BODY_BYTES)",
                )
        return await call_next(request)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await SqliteStore.open(settings.data_dir / "kernelhub.sqlite3")
        backend = make_backend(settings, instance=settings.gateway.instance)
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
        app.state.settings = settings
        app.state.store = store
        app.state.manager = manager
        app.state.batches = batches
        app.state.metrics = metrics
        app.state.ready = False
        try:
            await manager.start()
            await batches.start()  # after the manager: it deletes leftover batch sessions
            app.state.ready = True
            log.info("kernelhub gateway ready on the %s backend", backend.name)
            yield
        finally:
            app.state.ready = False
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
    errors.install(app)
    openapi.install(app)
    app.include_router(routes.router)
    app.include_router(stream.router)
    app.include_router(jupyter_api.router)  # Jupyter Server's /api, for Jupyter's own clients
    app.include_router(jupyter_channels.router)
    return app
