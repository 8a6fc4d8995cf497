"""The Jupyter Server kernels API (``/api``): the subset JupyterLab and Jupyter Server's
gateway client (``--GatewayClient.url``) call. Its channels WebSocket is
:mod:`kernelhub.gateway.jupyter_channels`; the messages are :mod:`kernelhub.jupyter.messages`.

A kernel *is* a kernelhub session of the caller's principal: ``POST /api/kernels`` creates
one through the session manager (same limits, quotas, hardening, audit), and every live
session of the caller is listed as a kernel. Kernel ids are UUIDs derived from session ids
(``messages.kernel_id``), since Jupyter Server's own routes only take UUID-shaped ids.
Jupyter clients send their token as ``Authorization: token <t>`` (or ``Bearer``), or as
``?token=``; someone else's kernel is 404, the same as one that never existed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response, Security
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, Field

from kernelhub import __version__
from kernelhub.errors import AuthError, NotFoundError, SessionClosedError
from kernelhub.gateway.auth import _SCHEME as BEARER_SCHEME
from kernelhub.gateway.auth import authenticate, client_address, require_unscoped
from kernelhub.gateway.routes import BODY, refusals
from kernelhub.jupyter import messages
from kernelhub.session.manager import LiveSession, SessionManager
from kernelhub.store.records import Principal
from kernelhub.wire import LimitsIn, SessionCreate, SessionInfo, SessionState

router = APIRouter()
_EXECUTION_STATE = {
    SessionState.STARTING: "starting",
    SessionState.READY: "idle",
    SessionState.BUSY: "busy",
    SessionState.PAUSED: "idle",
    SessionState.HIBERNATED: "idle",
    SessionState.DEAD: "dead",
    SessionState.DELETED: "dead",
}


def jupyter_token(authorization: str | None, query_token: str | None) -> str | None:
    """The token a Jupyter client sends: ``token <t>`` or ``Bearer <t>``, else ``?token=``."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() in ("token", "bearer") and token.strip():
            return token.strip()
    return query_token or None


async def jupyter_principal(
    request: Request,
    _: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER_SCHEME)] = None,
) -> Principal:
    token = jupyter_token(request.headers.get("authorization"), request.query_params.get("token"))
    try:
        caller = await authenticate(request.app.state.store, token)
    except AuthError as exc:
        raise AuthError(
            f"{exc}; Jupyter clients send `Authorization: token <t>` "
            "(GatewayClient.auth_token) or `?token=<t>`"
        ) from exc
    return require_unscoped(caller, "Jupyter kernels API")


Caller = Annotated[Principal, Depends(jupyter_principal)]


@dataclass
class JupyterState:
    """What the Jupyter API keeps between requests, on ``app.state.jupyter``."""

    session_ids: dict[str, str] = field(default_factory=dict)  # kernel id -> session id
    connections: dict[str, set[Any]] = field(default_factory=dict)  # session id -> channels
    last_activity: dict[str, float] = field(default_factory=dict)  # session id -> time.time()

    def touch(self, session_id: str) -> None:
        self.last_activity[session_id] = time.time()


def state_of(app: Any) -> JupyterState:
    state: JupyterState | None = getattr(app.state, "jupyter", None)
    if state is None:
        state = app.state.jupyter = JupyterState()
    return state


async def resolve(app: Any, principal: Principal, kernel: str) -> SessionInfo:
    """The caller's session behind a kernel id; NotFoundError for anyone else's, an id
    that is not one, or a session that has ended (Jupyter has no 'gone' answer)."""
    manager: SessionManager = app.state.manager
    state = state_of(app)
    session_id = state.session_ids.get(kernel)
    if session_id is None:
        for info in await manager.list_sessions(principal):
            state.session_ids[messages.kernel_id(info.id)] = info.id
        session_id = state.session_ids.get(kernel)
    missing = NotFoundError(f"no kernel {kernel!r} (or it is not yours)")
    if session_id is None:
        raise missing
    try:
        info = await manager.info(principal, session_id)
    except (NotFoundError, SessionClosedError):
        raise missing from None
    if info.state in (SessionState.DEAD, SessionState.DELETED):
        raise missing
    return info


def kernel_model(app: Any, info: SessionInfo) -> dict[str, Any]:
    state = state_of(app)
    state.session_ids[messages.kernel_id(info.id)] = info.id
    active = state.last_activity.get(info.id)
    when = info.created_at if active is None else _from_epoch(active)
    return {
        "id": messages.kernel_id(info.id),
        "name": messages.KERNEL_NAME,
        "last_activity": messages.jupyter_time(when),
        "execution_state": _EXECUTION_STATE.get(info.state, "idle"),
        "connections": len(state.connections.get(info.id, ())),
        "kernelhub": {
            "session_id": info.id,
            "owner": info.owner,
            "state": info.state.value,
            "limits": info.limits,
            "metadata": info.metadata,
        },
    }


def _from_epoch(seconds: float) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, UTC)


async def restart(
    app: Any, principal: Principal, live: LiveSession, client: str | None = None
) -> None:
    """Jupyter's restart is the session's restart (a fresh kernel in the same sandbox,
    variables gone, files kept, in turn, audited as ``session.restart``)."""
    manager: SessionManager = app.state.manager
    await manager.restart(principal, live.id, client)
    state_of(app).touch(live.id)


class KernelCreate(BaseModel):
    """``POST /api/kernels`` as Jupyter clients send it, plus kernelhub's own options."""

    name: str | None = Field(None, description=f"the kernelspec; only {messages.KERNEL_NAME!r}")
    path: str | None = None
    env: dict[str, str] | None = Field(None, description="ignored: a sandbox takes no host env")
    limits: LimitsIn = Field(default_factory=LimitsIn)


def kernelspec(app: Any) -> dict[str, Any]:
    limits = app.state.settings.limits.model_dump()
    return {
        "name": messages.KERNEL_NAME,
        "spec": {
            "argv": [],
            "display_name": "Python 3 (kernelhub sandbox)",
            "language": "python",
            "interrupt_mode": "message",
            "env": {},
            "metadata": {
                "kernelhub": {
                    "version": __version__,
                    "backend": app.state.settings.backend,
                    "limits": limits,
                }
            },
        },
        "resources": {},
    }


@router.get("/api", tags=["jupyter"])
async def api_root() -> dict[str, str]:
    """Jupyter Server's version probe."""
    return {"version": __version__, "implementation": "kernelhub"}


@router.get("/api/kernelspecs", responses=refusals(), tags=["jupyter"])
async def list_kernelspecs(request: Request, caller: Caller) -> dict[str, Any]:
    """The one kernel kernelhub runs: sandboxed IPython, with its limits in the metadata."""
    spec = kernelspec(request.app)
    return {"default": messages.KERNEL_NAME, "kernelspecs": {messages.KERNEL_NAME: spec}}


@router.get("/api/kernelspecs/{name}", responses=refusals(404, 422), tags=["jupyter"])
async def get_kernelspec(name: str, request: Request, caller: Caller) -> dict[str, Any]:
    if name != messages.KERNEL_NAME:
        raise NotFoundError(f"no kernelspec {name!r}; the gateway has {messages.KERNEL_NAME!r}")
    return kernelspec(request.app)


@router.get("/api/kernels", responses=refusals(), tags=["jupyter"])
async def list_kernels(request: Request, caller: Caller) -> list[dict[str, Any]]:
    """Every live session of the caller, as a running kernel."""
    manager: SessionManager = request.app.state.manager
    sessions = await manager.list_sessions(caller)
    ended = (SessionState.DEAD, SessionState.DELETED)
    return [kernel_model(request.app, s) for s in sessions if s.state not in ended]


@router.post(
    "/api/kernels", status_code=201, responses=refusals(*BODY, 404, 409, 429, 503), tags=["jupyter"]
)
async def start_kernel(body: KernelCreate, request: Request, caller: Caller) -> dict[str, Any]:
    """A new session of the caller's principal (``limits`` as in ``POST /v1/sessions``)."""
    if body.name not in (None, "", messages.KERNEL_NAME):
        raise NotFoundError(
            f"no kernelspec {body.name!r}; the gateway has {messages.KERNEL_NAME!r}"
        )
    manager: SessionManager = request.app.state.manager
    metadata: dict[str, str | int | float | bool | None] = {"created_by": "jupyter"}
    if body.path:
        metadata["jupyter_path"] = body.path[:1024]
    info = await manager.create(
        caller, SessionCreate(limits=body.limits, metadata=metadata), client_address(request)
    )
    return kernel_model(request.app, info)


@router.get("/api/kernels/{kernel_id}", responses=refusals(404, 422), tags=["jupyter"])
async def get_kernel(kernel_id: str, request: Request, caller: Caller) -> dict[str, Any]:
    return kernel_model(request.app, await resolve(request.app, caller, kernel_id))


@router.delete(
    "/api/kernels/{kernel_id}", status_code=204, responses=refusals(404, 422), tags=["jupyter"]
)
async def delete_kernel(kernel_id: str, request: Request, caller: Caller) -> Response:
    """Deletes the session (the agent's too, if it shares it)."""
    info = await resolve(request.app, caller, kernel_id)
    manager: SessionManager = request.app.state.manager
    await manager.delete(caller, info.id, client_address(request))
    return Response(status_code=204)


@router.post(
    "/api/kernels/{kernel_id}/interrupt",
    status_code=204,
    responses=refusals(404, 409, 422),
    tags=["jupyter"],
)
async def interrupt_kernel(kernel_id: str, request: Request, caller: Caller) -> Response:
    """Interrupts the running cell (KeyboardInterrupt; variables kept); idle: nothing to do."""
    info = await resolve(request.app, caller, kernel_id)
    manager: SessionManager = request.app.state.manager
    live = await manager.live(caller, info.id)
    running = live.kernel.running if live.kernel else None
    if running is not None:
        await manager.interrupt(caller, running.id)
    return Response(status_code=204)


@router.post(
    "/api/kernels/{kernel_id}/restart", responses=refusals(404, 409, 422), tags=["jupyter"]
)
async def restart_kernel(kernel_id: str, request: Request, caller: Caller) -> dict[str, Any]:
    """A fresh kernel process in the same sandbox: variables gone, files kept."""
    info = await resolve(request.app, caller, kernel_id)
    manager: SessionManager = request.app.state.manager
    live = await manager.live(caller, info.id)
    for conn in list(state_of(request.app).connections.get(info.id, ())):
        conn.broadcast_status("restarting")
    await restart(request.app, caller, live, client_address(request))
    for conn in list(state_of(request.app).connections.get(info.id, ())):
        conn.broadcast_status("idle")
    return kernel_model(request.app, await manager.info(caller, info.id))
