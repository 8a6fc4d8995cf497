"""Which node agent answers a request a gateway replica received.

:func:`classify` is pure: a request's method, path and headers in, a :class:`Target` out
(a session by id, an execution by id, a Jupyter kernel id, a new session, or any node).
It knows every route of the app a node serves (``kernelhub/gateway``, the review page):

- ``/v1/sessions/{id}/...`` (REST, files, the stream WebSocket), ``/e2b/sandboxes/{id}``
  and ``/e2b/v2/sandboxes/{id}/...``, and E2B's sandbox plane (``/e2b/execute``,
  ``/files``, ``/contexts``, ``/health``, ``/filesystem.Filesystem/*``: the sandbox is
  the ``E2b-Sandbox-Id`` header): the session's node.
- ``/v1/executions/{id}/...``: the node of the execution's session.
- ``/api/kernels/{kernel_id}...`` (Jupyter REST and channels): the kernel id is derived
  from the session id (``jupyter.messages.kernel_id``), so the caller's sessions are
  looked up to find it.
- ``POST /v1/sessions``, ``POST /api/kernels``, ``POST /e2b[/v2]/sandboxes``,
  ``POST /v1/batches``: placement's choice.
- Everything else (listings, snapshots, whoami, admin, the review page, OpenAPI) reads
  the shared store: any live node answers it the same.

:class:`Router` resolves a target to a node with the store (the one seam it uses). It
keeps no session state: each request looks the session's row up, so a session another
node adopted is found there at once.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import Enum
from urllib.parse import parse_qs

from kernelhub.cluster import placement
from kernelhub.cluster.models import NodeInfo
from kernelhub.errors import NodeUnavailableError
from kernelhub.store.base import Store
from kernelhub.store.records import Principal


class Kind(Enum):
    SESSION = "session"
    EXECUTION = "execution"
    KERNEL = "kernel"  # a Jupyter kernel id
    CREATE = "create"
    ANY = "any"


@dataclass(frozen=True)
class Target:
    kind: Kind
    id: str | None = None


ANY = Target(Kind.ANY)
CREATE = Target(Kind.CREATE)
_CREATES = frozenset(
    ["/v1/sessions", "/api/kernels", "/e2b/sandboxes", "/e2b/v2/sandboxes", "/v1/batches"]
)
_E2B_SANDBOX_PLANE = frozenset(["/e2b/health", "/e2b/contexts", "/e2b/execute", "/e2b/files"])


def classify(method: str, path: str, headers: Mapping[str, str]) -> Target:
    """The target of a request; ``headers`` with lower-case names."""
    path = path.rstrip("/") or "/"
    if path in _CREATES:
        return CREATE if method == "POST" else ANY
    parts = path.split("/")[1:]  # "/v1/sessions/x/stream" -> ["v1", "sessions", "x", "stream"]
    if len(parts) >= 3 and parts[:2] == ["v1", "sessions"]:
        return Target(Kind.SESSION, parts[2])
    if len(parts) >= 3 and parts[:2] == ["v1", "executions"]:
        return Target(Kind.EXECUTION, parts[2])
    if len(parts) >= 3 and parts[:2] == ["api", "kernels"]:
        return Target(Kind.KERNEL, parts[2])
    if len(parts) >= 3 and parts[:2] == ["e2b", "sandboxes"]:
        return Target(Kind.SESSION, parts[2])
    if len(parts) >= 4 and parts[:3] == ["e2b", "v2", "sandboxes"]:
        return Target(Kind.SESSION, parts[3])
    if path in _E2B_SANDBOX_PLANE or path.startswith("/e2b/filesystem.Filesystem/"):
        sandbox = headers.get("e2b-sandbox-id")
        return Target(Kind.SESSION, sandbox) if sandbox else ANY
    return ANY


_TOKEN_HEADERS = ("x-api-key", "e2b-traffic-access-token", "x-access-token")


def credential(headers: Mapping[str, str], query: str) -> str | None:
    """The token a request carries, wherever its API puts it: ``Authorization: Bearer``
    (or Jupyter's ``token``), E2B's key headers, ``?token=``, the review page's sign-in
    cookie. None: the node decides (health checks and the review page need none)."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() in ("bearer", "token") and value.strip():
        return value.strip()
    for name in _TOKEN_HEADERS:
        if headers.get(name):
            return headers[name]
    tokens = parse_qs(query).get("token")
    if tokens and tokens[0]:
        return tokens[0]
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == "kh_session" and value:
            return value
    return None


def requested_memory(body: bytes, default: int) -> int:
    """``limits.memory_bytes`` of a create's JSON body, else ``default`` (what the node
    gives a session that asks nothing); a body placement cannot read is the node's to
    refuse, not the replica's."""
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        return default
    limits = doc.get("limits") if isinstance(doc, dict) else None
    memory = limits.get("memory_bytes") if isinstance(limits, dict) else None
    return memory if isinstance(memory, int) and memory > 0 else default


class Router:
    """Targets to nodes, through the shared store. Heartbeat rows are read at most every
    ``nodes_ttl`` seconds (they change that often at most); session rows on every request."""

    def __init__(self, store: Store, *, nodes_ttl: float, default_memory_bytes: int) -> None:
        self.store = store
        self.nodes_ttl = nodes_ttl
        self.default_memory_bytes = default_memory_bytes
        self._nodes: list[NodeInfo] = []
        self._nodes_at: datetime | None = None
        self._placed: list[placement.Placed] = []
        self._kernels: dict[str, str] = {}  # kernel id -> session id (derived, never stale)
        # Nodes a connection to failed lately, until when: new work skips them meanwhile.
        self._suspects: dict[str, datetime] = {}

    def suspect(self, node_id: str) -> None:
        """A connection to ``node_id`` failed: place nothing there for ``nodes_ttl`` × 5
        seconds (its heartbeat row may say it is alive for a while yet)."""
        self._suspects[node_id] = datetime.now(UTC) + timedelta(seconds=5 * self.nodes_ttl)

    async def _usable(self) -> list[NodeInfo]:
        now = datetime.now(UTC)
        nodes = await self.nodes()
        usable = [n for n in nodes if self._suspects.get(n.id, now) <= now]
        return usable or nodes  # all suspect: try them anyway, the error then says why

    async def nodes(self, *, fresh: bool = False) -> list[NodeInfo]:
        now = datetime.now(UTC)
        stale = self._nodes_at is None or now - self._nodes_at > timedelta(seconds=self.nodes_ttl)
        if fresh or stale:
            self._nodes = await self.store.list_nodes()
            self._nodes_at = now
            # Placements older than every beat since are in the rows now.
            oldest = min((n.heartbeat_at for n in self._nodes), default=now)
            self._placed = [p for p in self._placed if p.at > oldest]
        return self._nodes

    async def node(self, node_id: str) -> NodeInfo:
        for n in await self.nodes():
            if n.id == node_id:
                return n
        for n in await self.nodes(fresh=True):
            if n.id == node_id:
                return n
        raise NodeUnavailableError(
            f"node {node_id!r} runs this session but has no heartbeat row; it may have been "
            "removed. Retry: its sessions move to other nodes once its lease runs out",
            node=node_id,
        )

    async def place(self, memory_bytes: int | None = None) -> NodeInfo:
        now = datetime.now(UTC)
        need = self.default_memory_bytes if memory_bytes is None else memory_bytes
        chosen = placement.choose(await self._usable(), now, memory_bytes=need, placed=self._placed)
        self._placed.append(placement.Placed(chosen.id, now, need))
        return chosen

    async def any_node(self) -> NodeInfo:
        now = datetime.now(UTC)
        alive = [n for n in await self._usable() if n.alive(now)]
        if not alive:
            return await self.place(0)  # raises, saying why
        return random.choice(alive)

    async def session_node(self, session_id: str) -> NodeInfo:
        row = await self.store.get_session(session_id)
        if row is None:
            return await self.any_node()  # it answers 404 in its API's own shape
        if row.node is None:
            return await self.place(row.limits.get("memory_bytes"))  # wakes where placed
        return await self.node(row.node)

    async def resolve(self, target: Target, principal: Principal | None, body: bytes) -> NodeInfo:
        if target.kind is Kind.CREATE:
            return await self.place(requested_memory(body, self.default_memory_bytes))
        if target.kind is Kind.SESSION and target.id:
            return await self.session_node(target.id)
        if target.kind is Kind.EXECUTION and target.id:
            row = await self.store.get_execution(target.id)
            return await (self.session_node(row.session_id) if row else self.any_node())
        if target.kind is Kind.KERNEL and target.id and principal is not None:
            session_id = await self._kernel_session(principal, target.id)
            if session_id is not None:
                return await self.session_node(session_id)
        return await self.any_node()

    async def _kernel_session(self, principal: Principal, kernel: str) -> str | None:
        from kernelhub.jupyter.messages import kernel_id

        if kernel not in self._kernels:
            if len(self._kernels) > 100_000:  # a cache: bounded, rebuilt as asked
                self._kernels.clear()
            for row in await self.store.list_sessions(principal.name):
                self._kernels[kernel_id(row.id)] = row.id
        return self._kernels.get(kernel)
