"""REST handlers: parse, authorize, call the session manager, shape the answer."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

import nbformat
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from kernelhub import jsonslices
from kernelhub.export import to_html, to_notebook
from kernelhub.gateway.auth import admin, client_address, metrics_reader, principal
from kernelhub.gateway.openapi import WS_SCHEMA_PATH
from kernelhub.session.batches import BatchRunner
from kernelhub.session.fanout import plain
from kernelhub.session.manager import SessionManager, execution_info
from kernelhub.store.records import AuditEntry, Principal
from kernelhub.tokens import TokenCreate, TokenCreated, mint
from kernelhub.wire import (
    BatchCreate,
    BatchInfo,
    BatchList,
    ErrorBody,
    ExecutionCreate,
    ExecutionInfo,
    InputReply,
    RewindReport,
    RewindRequest,
    SessionCreate,
    SessionInfo,
    SessionList,
    SnapshotInfo,
    SnapshotList,
    frames_json_schema,
)

router = APIRouter()
Caller = Annotated[Principal, Depends(principal)]
Admin = Annotated[Principal, Depends(admin)]


def refusals(*statuses: int) -> dict[int | str, dict[str, object]]:
    """The error answers a route documents, each an ``ErrorBody``: 401 for every
    authenticated route, plus ``statuses``. docs/protocol.md's route table lists the same
    (tests/unit/gateway/test_protocol_doc.py holds them together)."""
    return {code: {"model": ErrorBody} for code in sorted({401, *statuses})}


BODY = (400, 413, 415, 422)  # a route that takes a JSON body
SESSION = (404, 409, 410, 422)  # a route on one of the caller's sessions
FULL = 507  # a route that stores: the principal's storage quota, or the disk floor
MetricsReader = Annotated[Principal, Depends(metrics_reader)]


def manager(request: Request) -> SessionManager:
    m: SessionManager = request.app.state.manager
    return m


def batches(request: Request) -> BatchRunner:
    b: BatchRunner = request.app.state.batches
    return b


@router.get("/healthz", tags=["health"])
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "not ready (yet)"}}, tags=["health"])
async def readyz(request: Request) -> JSONResponse:
    ready = getattr(request.app.state, "ready", False)
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)


@router.get("/metrics", responses=refusals(), tags=["health"])
async def metrics(request: Request, caller: MetricsReader) -> Response:
    """Any valid token (or KERNELHUB_GATEWAY__METRICS_TOKEN) reads the totals; only an
    admin also sees the per-session series, which name every tenant's sessions."""
    text = request.app.state.metrics.exposition(per_session=caller.admin)
    return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/whoami", responses=refusals(), tags=["tokens"])
async def whoami(caller: Caller) -> Principal:
    """The principal the token stands for (the MCP server checks its clients' tokens here)."""
    return caller


@router.get(WS_SCHEMA_PATH, tags=["stream"])
async def ws_schema() -> dict[str, Any]:
    """The JSON Schema of every WebSocket frame of the event stream, both ways (generated
    from ``kernelhub/wire.py``; the same as ``docs/ws-frames.schema.json``)."""
    return frames_json_schema()


@router.post(
    "/v1/sessions",
    status_code=201,
    responses=refusals(*BODY, 404, 409, 429, 503, FULL),
    tags=["sessions"],
)
async def create_session(body: SessionCreate, request: Request, caller: Caller) -> SessionInfo:
    return await manager(request).create(caller, body, client_address(request))


@router.get("/v1/sessions", responses=refusals(), tags=["sessions"])
async def list_sessions(request: Request, caller: Caller) -> SessionList:
    sessions = await manager(request).list_sessions(caller)
    if caller.session_id is not None:  # a session-scoped token sees its one session
        sessions = [s for s in sessions if s.id == caller.session_id]
    return SessionList(sessions=sessions)


@router.get("/v1/sessions/{session_id}", responses=refusals(404, 410, 422), tags=["sessions"])
async def get_session(session_id: str, request: Request, caller: Caller) -> SessionInfo:
    return await manager(request).info(caller, session_id)


@router.delete(
    "/v1/sessions/{session_id}",
    status_code=204,
    responses=refusals(404, 410, 422),
    tags=["sessions"],
)
async def delete_session(
    session_id: str, request: Request, caller: Caller, purge: bool = False
) -> Response:
    """End the session. Its events and executions are kept for the retention period
    (KERNELHUB_STORAGE__RETENTION); ``purge=true`` deletes them now and returns the space."""
    await manager(request).delete(caller, session_id, client_address(request), purge=purge)
    return Response(status_code=204)


@router.post(
    "/v1/sessions/{session_id}/snapshots",
    status_code=201,
    responses=refusals(*SESSION, 503, FULL),
    tags=["snapshots"],
)
async def create_snapshot(session_id: str, request: Request, caller: Caller) -> SnapshotInfo:
    """Dump the namespace (and /workspace) inside the sandbox; stored as an opaque blob.
    Restore with ``POST /v1/sessions {"from_snapshot": id}``."""
    return await manager(request).snapshot(caller, session_id, client_address(request))


@router.post(
    "/v1/sessions/{session_id}/rewind", responses=refusals(*BODY, *SESSION), tags=["snapshots"]
)
async def rewind_session(
    session_id: str, body: RewindRequest, request: Request, caller: Caller
) -> RewindReport:
    """Undo cell ``before_cell`` and everything after it, from the automatic checkpoint
    taken before it (sessions created with ``checkpoints``)."""
    return await manager(request).rewind(
        caller, session_id, body.before_cell, client_address(request)
    )


@router.get("/v1/snapshots", responses=refusals(), tags=["snapshots"])
async def list_snapshots(request: Request, caller: Caller) -> SnapshotList:
    return SnapshotList(snapshots=await manager(request).snapshots(caller))


@router.delete(
    "/v1/snapshots/{snapshot_id}", status_code=204, responses=refusals(404, 422), tags=["snapshots"]
)
async def delete_snapshot(snapshot_id: str, request: Request, caller: Caller) -> Response:
    await manager(request).delete_snapshot(caller, snapshot_id)
    return Response(status_code=204)


@router.post("/v1/sessions/{session_id}/pause", responses=refusals(*SESSION), tags=["sessions"])
async def pause_session(session_id: str, request: Request, caller: Caller) -> SessionInfo:
    """Freeze the sandbox (cgroup freezer). While paused, execute, interrupt and snapshot
    answer 409; delete works."""
    return await manager(request).pause(caller, session_id, client_address(request))


@router.post("/v1/sessions/{session_id}/restart", responses=refusals(*SESSION), tags=["sessions"])
async def restart_session(session_id: str, request: Request, caller: Caller) -> SessionInfo:
    """A fresh kernel in the same sandbox: variables gone, files kept (after the cells
    queued before it)."""
    await manager(request).restart(caller, session_id, client_address(request))
    return await manager(request).info(caller, session_id)


@router.post("/v1/sessions/{session_id}/resume", responses=refusals(*SESSION), tags=["sessions"])
async def resume_session(session_id: str, request: Request, caller: Caller) -> SessionInfo:
    return await manager(request).resume(caller, session_id, client_address(request))


@router.post(
    "/v1/sessions/{session_id}/executions",
    responses={
        **refusals(*BODY, *SESSION, 429, FULL),
        200: {"model": ExecutionInfo},
        202: {"model": ExecutionInfo},
    },
    tags=["executions"],
)
async def create_execution(
    session_id: str, body: ExecutionCreate, request: Request, caller: Caller
) -> Response:
    """Run code. With ``wait`` the answer is the finished execution (200); otherwise 202
    with the execution to poll or stream. A repeated ``idempotency_key`` returns the first
    execution and runs nothing."""
    m = manager(request)
    row, handle, created = await m.submit(caller, session_id, body, client_address(request))
    done = None
    if body.wait and handle is not None:
        # The cell keeps running if this client goes away; only the wait is abandoned.
        done = await asyncio.shield(handle.wait())
        await m.settled(row.id)  # durable before we answer
    if done is not None and created:
        # Straight from memory: this request asked to wait, so its handle kept the events.
        row = row.model_copy(update={"status": done.record.status, "record": done.record})
        info = execution_info(row, done.events)
    else:
        row, events = await m.execution(caller, row.id)
        info = execution_info(row, events)
    return await _execution_answer(info, 200 if row.record else 202)


@router.get(
    "/v1/executions/{execution_id}",
    responses={**refusals(404, 422), 200: {"model": ExecutionInfo}},
    tags=["executions"],
)
async def get_execution(
    execution_id: str, request: Request, caller: Caller, events: bool = True
) -> Response:
    """``events=false`` answers with the status and record only (cheap polling)."""
    row, outputs = await manager(request).execution(caller, execution_id, events=events)
    return await _execution_answer(execution_info(row, outputs), 200)


async def _execution_answer(info: ExecutionInfo, status: int) -> Response:
    """An execution as JSON, written a slice at a time when its events are big (one
    8 MiB output in one json.dumps held the loop for every tenant, issue #16)."""
    # The events as fanout.plain gives them: pydantic's model_dump would copy all their
    # values in one call (~50 ms for 8 MiB of numbers).
    value = info.model_dump(mode="json", exclude={"events"})
    value["events"] = None if info.events is None else [plain(e) for e in info.events]
    try:
        body = await jsonslices.drive(jsonslices.dumps(value, info.model_dump_json))
    except (TypeError, ValueError):  # a value json cannot write: pydantic's way, whole
        body = info.model_dump_json()
    return Response(body.encode(), status_code=status, media_type="application/json")


@router.post(
    "/v1/executions/{execution_id}/interrupt",
    status_code=202,
    responses=refusals(*SESSION),
    tags=["executions"],
)
async def interrupt_execution(execution_id: str, request: Request, caller: Caller) -> ExecutionInfo:
    row = await manager(request).interrupt(caller, execution_id)
    return execution_info(row, None)


@router.post(
    "/v1/executions/{execution_id}/cancel", responses=refusals(*SESSION), tags=["executions"]
)
async def cancel_execution(execution_id: str, request: Request, caller: Caller) -> ExecutionInfo:
    row = await manager(request).cancel(caller, execution_id)
    return execution_info(row, None)


@router.post(
    "/v1/executions/{execution_id}/input",
    status_code=202,
    responses=refusals(*BODY, *SESSION),
    tags=["executions"],
)
async def reply_input(
    execution_id: str, body: InputReply, request: Request, caller: Caller
) -> dict[str, str]:
    await manager(request).send_input(caller, execution_id, body.value)
    return {"status": "sent"}


@router.put(
    "/v1/sessions/{session_id}/files/{path:path}",
    status_code=201,
    responses=refusals(*SESSION, 400, 413),
    tags=["files"],
)
async def upload_file(
    session_id: str, path: str, request: Request, caller: Caller
) -> dict[str, object]:
    """Stream the raw body into ``/workspace/<path>`` (size-capped; no ``..``, no symlinks)."""
    size = await manager(request).upload(
        caller, session_id, path, request.stream(), client_address(request)
    )
    return {"path": path, "size": size}


@router.get(
    "/v1/sessions/{session_id}/files/{path:path}", responses=refusals(*SESSION, 400), tags=["files"]
)
async def download_file(
    session_id: str, path: str, request: Request, caller: Caller
) -> StreamingResponse:
    chunks = await manager(request).download(caller, session_id, path, client_address(request))
    return StreamingResponse(chunks, media_type="application/octet-stream")


# -- batches -----------------------------------------------------------------------------


@router.post("/v1/batches", status_code=202, responses=refusals(*BODY, 429, FULL), tags=["batches"])
async def create_batch(body: BatchCreate, request: Request, caller: Caller) -> BatchInfo:
    """Run many items, each in a fresh session of its own, at most ``concurrency`` at a
    time. Answers at once; poll ``GET /v1/batches/{id}``. ``429`` with ``Retry-After`` when
    the gateway has too many items waiting."""
    return await batches(request).submit(caller, body)


@router.get("/v1/batches", responses=refusals(), tags=["batches"])
async def list_batches(request: Request, caller: Caller) -> BatchList:
    return BatchList(batches=await batches(request).list_batches(caller))


@router.get("/v1/batches/{batch_id}", responses=refusals(404, 422), tags=["batches"])
async def get_batch(
    batch_id: str, request: Request, caller: Caller, results: bool = True
) -> BatchInfo:
    """``results=false`` leaves out the items' executions (cheap polling)."""
    return await batches(request).info(caller, batch_id, results=results)


@router.post("/v1/batches/{batch_id}/cancel", responses=refusals(404, 422), tags=["batches"])
async def cancel_batch(batch_id: str, request: Request, caller: Caller) -> BatchInfo:
    """Queued items become ``cancelled``; running ones are interrupted."""
    return await batches(request).cancel(caller, batch_id)


@router.get("/v1/admin/sessions", responses=refusals(403), tags=["admin"])
async def admin_sessions(request: Request, caller: Admin) -> SessionList:
    return SessionList(sessions=await manager(request).list_sessions(caller, everyone=True))


@router.post("/v1/admin/stop-all", responses=refusals(403), tags=["admin"])
async def admin_stop_all(request: Request, caller: Admin) -> dict[str, int]:
    return {"stopped": await manager(request).stop_all(caller, client_address(request))}


class AuditPage(BaseModel):
    entries: list[dict[str, Any]]
    next_before: int | None = None


@router.get("/v1/admin/audit", responses=refusals(403, 422), tags=["admin"])
async def admin_audit(
    request: Request,
    caller: Admin,
    principal: str | None = None,
    action: str | None = None,
    session_id: str | None = None,
    text: Annotated[str | None, Query(max_length=200)] = None,
    before: int | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AuditPage:
    """The audit log, newest first, a page at a time: pass ``next_before`` as ``before``
    for the next. Filters: who, what action, which session, text in the code or detail."""
    rows = await request.app.state.store.audit_log(
        session_id, principal=principal, action=action, text=text, before=before, limit=limit
    )
    more = rows[-1]["id"] if len(rows) == limit else None
    return AuditPage(entries=rows, next_before=more)


@router.post(
    "/v1/admin/tokens", status_code=201, responses=refusals(*BODY, 403, 404, 409), tags=["admin"]
)
async def admin_mint_token(body: TokenCreate, request: Request, caller: Admin) -> TokenCreated:
    """Mint a token, e.g. a read-only one for one session that expires, for a browser."""
    minted = await mint(request.app.state.store, body)
    await request.app.state.store.audit(
        AuditEntry(
            principal=caller.name,
            action="token_create",
            session_id=body.session_id,
            client=client_address(request),
            detail={"name": body.name, "read_only": body.read_only, "expires_in": body.expires_in},
        )
    )
    return minted


# -- notebook export ---------------------------------------------------------------------


@router.get(
    "/v1/sessions/{session_id}/notebook",
    responses={
        **refusals(404, 410, 422),
        200: {"content": {"application/x-ipynb+json": {}, "text/html": {}}},
    },
    tags=["sessions"],
)
async def export_notebook(
    session_id: str,
    request: Request,
    caller: Caller,
    fmt: Annotated[Literal["ipynb", "html"], Query(alias="format")] = "ipynb",
) -> Response:
    """The session's executions as a Jupyter notebook (nbformat 4), or with
    ``format=html`` as a self-contained, script-free page. Cells that did not complete are
    marked, and tagged ``kernelhub-skip-rerun`` for anyone re-executing the notebook."""
    info = await manager(request).info(caller, session_id)  # NotFoundError unless yours
    store = request.app.state.store
    executions = [
        (row, await store.events_of(row.id)) for row in await store.executions_of(session_id)
    ]
    between = await store.session_events_of(session_id)
    nb = await asyncio.to_thread(to_notebook, info, executions, between)
    if fmt == "html":
        return Response(await asyncio.to_thread(to_html, nb), media_type="text/html")
    body = await asyncio.to_thread(nbformat.writes, nb)
    return Response(
        body,
        media_type="application/x-ipynb+json",
        headers={"Content-Disposition": f'attachment; filename="{session_id}.ipynb"'},
    )
