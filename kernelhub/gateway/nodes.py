"""The admin routes on the cluster's node agents (issue #24): list them with their
heartbeat numbers, drain one (its sessions hibernate and wake elsewhere), undrain it."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from kernelhub.cluster.models import NodeInfo
from kernelhub.errors import NotFoundError
from kernelhub.gateway.auth import client_address
from kernelhub.gateway.routes import Admin, refusals
from kernelhub.store.base import Store
from kernelhub.store.records import AuditEntry

router = APIRouter()


class NodeView(NodeInfo):
    lost: bool = Field(description="its lease ran out (lease_expires_at has passed)")


class NodeList(BaseModel):
    nodes: list[NodeView]


def _view(n: NodeInfo, now: datetime) -> NodeView:
    return NodeView(**n.model_dump(), lost=not n.alive(now))


@router.get("/v1/admin/nodes", responses=refusals(403), tags=["admin"])
async def admin_nodes(request: Request, caller: Admin) -> NodeList:
    """Every node agent that ever beat, alive or lost, with its last heartbeat's numbers."""
    now = datetime.now(UTC)
    return NodeList(nodes=[_view(n, now) for n in await _store(request).list_nodes()])


@router.post("/v1/admin/nodes/{node_id}/drain", responses=refusals(403, 404, 422), tags=["admin"])
async def admin_drain(node_id: str, request: Request, caller: Admin) -> NodeView:
    """The node takes no new sessions; its sessions hibernate one by one and each wakes on
    its next call wherever placement puts it."""
    return await _set_draining(request, caller.name, node_id, True)


@router.post("/v1/admin/nodes/{node_id}/undrain", responses=refusals(403, 404, 422), tags=["admin"])
async def admin_undrain(node_id: str, request: Request, caller: Admin) -> NodeView:
    """The node takes sessions again (those that left stay where they woke)."""
    return await _set_draining(request, caller.name, node_id, False)


async def _set_draining(request: Request, who: str, node_id: str, draining: bool) -> NodeView:
    store = _store(request)
    if not await store.set_draining(node_id, draining):
        raise NotFoundError(f"no node {node_id!r}; `GET /v1/admin/nodes` lists them")
    action = "admin.drain" if draining else "admin.undrain"
    await store.audit(
        AuditEntry(principal=who, action=action, client=client_address(request),
                   detail={"node": node_id})
    )  # fmt: skip
    node = await store.get_node(node_id)
    assert node is not None  # just updated; nodes are deleted only by an operator
    return _view(node, datetime.now(UTC))


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store
