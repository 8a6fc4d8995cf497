"""The E2B drop-in: the unmodified ``e2b-code-interpreter`` SDK runs against kernelhub.

Point the SDK at one gateway URL for both planes (its own documented settings)::

    E2B_API_URL=http://127.0.0.1:8000/e2b  E2B_SANDBOX_URL=http://127.0.0.1:8000/e2b
    E2B_API_KEY=<a kernelhub token>

Both planes live under ``/e2b``; their paths do not collide. The control plane (``X-API-Key``)
creates, connects, lists, kills and times out sandboxes; each sandbox is a kernelhub session
of the key's principal, with the same hardening, limits, audit and record as any other.
The sandbox plane names the sandbox in the ``E2b-Sandbox-Id`` header and authenticates with
the access token the create answer gave (the caller's own token): ``/execute`` (NDJSON),
``/contexts``, envd's ``/health`` and ``/files``, and envd's Connect-RPC
``/filesystem.Filesystem/ListDir`` in its JSON form.

Served subset, and where it differs from E2B: one kernel per sandbox (``/contexts`` answers
the default context; other context ids are refused), Python only, files only in /workspace
(``/home/user`` is its alias), no commands/PTY/watchers. Past its timeout a sandbox's
session is deleted (by :func:`reap`, within a second; after a gateway restart, when it is
next used or listed). Routes are kept
out of the OpenAPI document (``include_in_schema=False``): the contract is E2B's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from kernelhub.errors import (
    AuthError,
    InvalidRequestError,
    KernelhubError,
    NotFoundError,
    SessionClosedError,
)
from kernelhub.gateway import e2b_wire as wire
from kernelhub.gateway.auth import authenticate, bearer, client_address, require_unscoped
from kernelhub.gateway.errors import status_for
from kernelhub.session.manager import SessionManager
from kernelhub.store.records import Principal
from kernelhub.wire import ExecutionCreate, SessionCreate, SessionInfo, SessionState

log = logging.getLogger(__name__)

PREFIX = "/e2b"
DEFAULT_TIMEOUT = 300  # seconds: E2B's default sandbox lifetime
MAX_TIMEOUT = 24 * 3600
TEMPLATE_KEY = "e2b.template"
TIMEOUT_KEY = "e2b.timeout"
DEFAULT_CONTEXT = "default"
LIST_TIMEOUT = 30.0
# Seconds between the reaper's looks for sandboxes past their timeout: E2B kills a sandbox
# at its deadline; a second late is within what its clients can observe.
REAP_INTERVAL = 1.0


class E2BRoute(APIRoute):
    """Answers kernelhub errors in E2B's shape, ``{"code": status, "message"}``; the
    status comes from the one table in gateway/errors.py."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except KernelhubError as exc:
                status, _ = status_for(exc)
                return JSONResponse({"code": status, "message": str(exc)}, status_code=status)

        return answer


router = APIRouter(prefix=PREFIX, route_class=E2BRoute, include_in_schema=False)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class NewSandbox(_Body):
    template_id: str = Field("code-interpreter-v1", alias="templateID")
    timeout: int = Field(DEFAULT_TIMEOUT, ge=0, le=MAX_TIMEOUT)
    metadata: dict[str, str] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict, alias="envVars")


class TimeoutBody(_Body):
    timeout: int = Field(ge=0, le=MAX_TIMEOUT)


class ConnectBody(_Body):
    timeout: int | None = Field(None, ge=0, le=MAX_TIMEOUT)


class ExecuteBody(_Body):
    code: str
    context_id: str | None = None
    language: str | None = None
    env_vars: dict[str, str] | None = None


class ContextBody(_Body):
    language: str | None = None
    cwd: str | None = None


class ListDirBody(_Body):
    path: str = ""
    depth: int = Field(1, ge=0, le=64)


def _manager(request: Request) -> SessionManager:
    m: SessionManager = request.app.state.manager
    return m


def _deadlines(request: Request) -> dict[str, datetime]:
    """set_timeout's deadlines, by session id (the create-time one is in the metadata)."""
    d: dict[str, datetime] = request.app.state.e2b_deadlines
    return d


async def _principal(request: Request, *headers: str) -> tuple[Principal, str]:
    """The caller of ``headers`` (the first present), and the token it sent."""
    token = bearer(request.headers.get("authorization"))
    for name in headers:
        token = request.headers.get(name) or token
    if token is None:
        raise AuthError(
            "missing API key; set E2B_API_KEY to a kernelhub token (`kernelhub token create --name NAME`)"
        )
    caller = await authenticate(request.app.state.store, token)
    return require_unscoped(caller, "E2B API"), token


def _deadline(request: Request, info: SessionInfo) -> datetime | None:
    """When the sandbox times out: the deadline this gateway set (at create, connect or
    set_timeout), else, after a restart, its creation plus the timeout it asked for; None
    for a session not made through the E2B API (it keeps kernelhub's own lifetime)."""
    known = _deadlines(request).get(info.id)
    if known is not None:
        return known
    timeout = info.metadata.get(TIMEOUT_KEY)
    if not isinstance(timeout, int):
        return None
    return info.created_at + timedelta(seconds=timeout)


def _end_at(request: Request, info: SessionInfo) -> datetime:
    end = _deadline(request, info)
    return end if end is not None else info.created_at + timedelta(seconds=DEFAULT_TIMEOUT)


def _alive(info: SessionInfo) -> bool:
    return info.state not in (SessionState.DEAD, SessionState.DELETED)


async def _expire(request: Request, principal: Principal, info: SessionInfo) -> bool:
    """Delete the session if its E2B timeout has passed (the reaper may not have looked
    yet); True if it did."""
    end = _deadline(request, info)
    if end is None or datetime.now(UTC) < end:
        return False
    with contextlib.suppress(NotFoundError):
        await _manager(request).delete(principal, info.id, client_address(request))
    _deadlines(request).pop(info.id, None)
    return True


async def _sandbox(request: Request, principal: Principal, sandbox_id: str) -> SessionInfo:
    """The caller's live sandbox ``sandbox_id``; E2B knows no "ended": NotFoundError."""
    gone = NotFoundError(f"sandbox {sandbox_id} not found (it ended or timed out)")
    try:
        info = await _manager(request).info(principal, sandbox_id)
    except SessionClosedError as exc:
        raise gone from exc
    if not _alive(info) or await _expire(request, principal, info):
        raise gone
    return info


def _record(request: Request, info: SessionInfo, token: str) -> dict[str, Any]:
    template = info.metadata.get(TEMPLATE_KEY)
    return wire.sandbox_record(
        sandbox_id=info.id,
        template=template if isinstance(template, str) else "kernelhub",
        started_at=info.created_at,
        end_at=_end_at(request, info),
        limits=info.limits,
        metadata={
            k: str(v)
            for k, v in info.metadata.items()
            if not k.startswith("e2b.") and v is not None
        },
        token=token,
        state="paused" if info.state == SessionState.PAUSED else "running",
    )


# -- control plane -----------------------------------------------------------------------


@router.post("/v2/sandboxes", status_code=201)
@router.post("/sandboxes", status_code=201)
async def create(body: NewSandbox, request: Request) -> dict[str, Any]:
    principal, token = await _principal(request, "x-api-key")
    if body.env_vars:
        raise InvalidRequestError(
            "kernelhub sandboxes take no environment variables (envs=); set them in code"
        )
    metadata: dict[str, str | int | float | bool | None] = {
        **body.metadata,
        TEMPLATE_KEY: body.template_id,
        TIMEOUT_KEY: body.timeout,
    }
    info = await _manager(request).create(
        principal, SessionCreate(metadata=metadata), client_address(request)
    )
    # The lifetime counts from when the sandbox is ready, not from the request.
    _deadlines(request)[info.id] = datetime.now(UTC) + timedelta(seconds=body.timeout)
    return _record(request, info, token)


@router.get("/v2/sandboxes")
@router.get("/sandboxes")
async def list_sandboxes(
    request: Request, state: str | None = None, metadata: str | None = None
) -> list[dict[str, Any]]:
    principal, token = await _principal(request, "x-api-key")
    wanted = set((state or "running,paused").split(","))
    match = wire.metadata_filter(metadata).items()
    out = []
    for info in await _manager(request).list_sessions(principal):
        if not _alive(info) or await _expire(request, principal, info):
            continue
        record = _record(request, info, token)
        if record["state"] in wanted and match <= record["metadata"].items():
            out.append(record)
    return out


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, request: Request) -> dict[str, Any]:
    principal, token = await _principal(request, "x-api-key")
    return _record(request, await _sandbox(request, principal, sandbox_id), token)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/connect")
async def connect(sandbox_id: str, body: ConnectBody, request: Request) -> dict[str, Any]:
    principal, token = await _principal(request, "x-api-key")
    info = await _sandbox(request, principal, sandbox_id)
    if body.timeout is not None:
        # Connecting extends the lifetime, never shortens it (as E2B does).
        end_at = datetime.now(UTC) + timedelta(seconds=body.timeout)
        if end_at > _end_at(request, info):
            _deadlines(request)[info.id] = end_at
    return _record(request, info, token)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: TimeoutBody, request: Request) -> Response:
    principal, _ = await _principal(request, "x-api-key")
    info = await _sandbox(request, principal, sandbox_id)
    _deadlines(request)[info.id] = datetime.now(UTC) + timedelta(seconds=body.timeout)
    return Response(status_code=204)


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill(sandbox_id: str, request: Request) -> Response:
    principal, _ = await _principal(request, "x-api-key")
    await _sandbox(request, principal, sandbox_id)
    await _manager(request).delete(principal, sandbox_id, client_address(request))
    _deadlines(request).pop(sandbox_id, None)
    return Response(status_code=204)


# -- sandbox plane -----------------------------------------------------------------------

_SANDBOX_TOKENS = ("x-api-key", "e2b-traffic-access-token", "x-access-token")


async def _target(request: Request) -> tuple[Principal, SessionInfo]:
    principal, _ = await _principal(request, *_SANDBOX_TOKENS)
    sandbox_id = request.headers.get("e2b-sandbox-id")
    if not sandbox_id:
        raise InvalidRequestError(
            "sandbox requests name their sandbox in the E2b-Sandbox-Id header"
        )
    return principal, await _sandbox(request, principal, sandbox_id)


@router.get("/health", status_code=204)
async def health(request: Request) -> Response:
    try:
        await _target(request)
    except NotFoundError:
        # What E2B's proxy answers for a sandbox that is gone; the SDK's is_running()
        # reads it as False.
        return Response(status_code=502)
    return Response(status_code=204)


@router.post("/contexts")
async def create_context(body: ContextBody, request: Request) -> dict[str, str]:
    await _target(request)
    if body.language not in (None, "python"):
        raise InvalidRequestError(f"kernelhub runs Python only, not {body.language!r}")
    return {"id": DEFAULT_CONTEXT, "language": "python", "cwd": wire.WORKSPACE}


@router.post("/execute")
async def execute(body: ExecuteBody, request: Request) -> StreamingResponse:
    principal, info = await _target(request)
    if body.language not in (None, "python"):
        raise InvalidRequestError(f"kernelhub runs Python only, not {body.language!r}")
    if body.context_id not in (None, DEFAULT_CONTEXT):
        raise NotFoundError(f"context {body.context_id!r} not found; kernelhub has one per sandbox")
    if body.env_vars:
        raise InvalidRequestError("kernelhub cells take no environment variables (envs=)")
    m = _manager(request)
    row, handle, _ = await m.submit(
        principal, info.id, ExecutionCreate(code=body.code, wait=True), client_address(request)
    )
    assert handle is not None  # no idempotency key: always a new execution

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in handle:
                for line in wire.execute_lines(event):
                    yield json.dumps(line) + "\n"
        finally:
            if handle.record is None:
                # The client went away (its own timeout, most often): stop the cell so the
                # next run_code does not queue behind it.
                with contextlib.suppress(KernelhubError):
                    await asyncio.shield(m.interrupt(principal, row.id))

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.get("/files")
async def read_file(request: Request, path: str) -> StreamingResponse:
    principal, info = await _target(request)
    chunks = await _manager(request).download(
        principal, info.id, wire.workspace_path(path), client_address(request)
    )
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.post("/files")
async def write_files(request: Request, path: str | None = None) -> list[dict[str, Any]]:
    principal, info = await _target(request)
    m = _manager(request)
    written = []
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form()
        for _, upload in form.multi_items():
            if isinstance(upload, str):
                continue
            target = wire.workspace_path(path or upload.filename or "")
            data = await upload.read()

            async def one(data: bytes = data) -> AsyncIterator[bytes]:
                yield data

            await m.upload(principal, info.id, target, one(), client_address(request))
            written.append(wire.write_info(target))
    else:
        target = wire.workspace_path(path or "")
        await m.upload(principal, info.id, target, request.stream(), client_address(request))
        written.append(wire.write_info(target))
    if not written:
        raise InvalidRequestError("the upload carried no file")
    return written


async def _entries(
    request: Request, path: str, expression: Callable[[str], str]
) -> list[dict[str, Any]]:
    """What ``expression`` (of the /workspace-relative path) finds, evaluated in the kernel
    outside the session's history, as envd ``EntryInfo`` messages."""
    principal, info = await _target(request)
    answers = await _manager(request).call_in_kernel(
        principal, info.id, "", {"ls": expression(wire.workspace_path(path))}, timeout=LIST_TIMEOUT
    )
    entries = wire.listing(answers)
    if entries is None:
        raise NotFoundError(f"{path!r} not found")
    return [wire.entry_info(e) for e in entries]


def _connect_error(exc: KernelhubError) -> JSONResponse:
    """A Connect-RPC error: ``{"code": <connect code>, "message"}``, the HTTP status from
    the one table."""
    status, _ = status_for(exc)
    code = wire.CONNECT_CODES.get(status, "internal")
    return JSONResponse({"code": code, "message": str(exc)}, status_code=status)


# Connect-RPC unary calls in their JSON form: the request message in, the answer out.


@router.post("/filesystem.Filesystem/ListDir")
async def list_dir(body: ListDirBody, request: Request) -> JSONResponse:
    depth = body.depth or 1
    try:
        entries = await _entries(request, body.path, lambda p: wire.list_expression(p, depth))
    except KernelhubError as exc:
        return _connect_error(exc)
    return JSONResponse({"entries": entries})


@router.post("/filesystem.Filesystem/Stat")
async def stat(body: ListDirBody, request: Request) -> JSONResponse:
    try:
        (entry,) = await _entries(request, body.path, wire.stat_expression)
    except KernelhubError as exc:
        return _connect_error(exc)
    return JSONResponse({"entry": entry})


async def reap(app: FastAPI) -> None:
    """Delete the sandboxes past their timeout, as E2B does. Runs for the app's lifetime:
    the lifespan starts it and cancels it. Looks only at the deadlines in memory."""
    manager: SessionManager = app.state.manager
    deadlines: dict[str, datetime] = app.state.e2b_deadlines
    while True:
        await asyncio.sleep(REAP_INTERVAL)
        now = datetime.now(UTC)
        for session_id, end in list(deadlines.items()):
            live = manager.sessions.get(session_id)
            if live is None or live.state in (SessionState.DEAD, SessionState.DELETED):
                deadlines.pop(session_id, None)
                continue
            if now < end:
                continue
            try:
                await manager.delete(Principal(name=live.stored.owner), session_id)
            except KernelhubError:
                pass  # it ended meanwhile
            except Exception:
                # Keep reaping the others; this one is tried again next round.
                log.exception("deleting sandbox %s past its E2B timeout failed", session_id)
                continue
            deadlines.pop(session_id, None)


def install(app: FastAPI) -> None:
    app.state.e2b_deadlines = {}
    app.include_router(router)
