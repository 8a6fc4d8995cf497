"""The node agents' rows (issue #24), as sans-I/O operations like queries.py's: heartbeats,
placement reads, draining, and moving a session from one node to another."""

from __future__ import annotations

from datetime import datetime

from kernelhub.cluster.models import NodeInfo
from kernelhub.store.queries import SESSION_COLUMNS, Op, Query, Row, session_of
from kernelhub.store.records import StoredSession

_COLUMNS = (
    "id, address, started_at, heartbeat_at, lease_expires_at, draining, sessions,"
    " memory_total_bytes, memory_free_bytes, cpu_load, version"
)


def _node(r: Row) -> NodeInfo:
    return NodeInfo(
        id=r[0],
        address=r[1],
        started_at=datetime.fromisoformat(r[2]),
        heartbeat_at=datetime.fromisoformat(r[3]),
        lease_expires_at=datetime.fromisoformat(r[4]),
        draining=bool(r[5]),
        sessions=r[6],
        memory_total_bytes=r[7],
        memory_free_bytes=r[8],
        cpu_load=r[9],
        version=r[10],
    )


def upsert_node(n: NodeInfo) -> Op[None]:
    """A heartbeat: the node's row, created or refreshed. ``draining`` is the operator's
    (``set_draining``): a heartbeat never clears it."""
    yield Query(
        f"INSERT INTO nodes ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)"
        " ON CONFLICT (id) DO UPDATE SET address = excluded.address,"
        " started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at,"
        " lease_expires_at = excluded.lease_expires_at, sessions = excluded.sessions,"
        " memory_total_bytes = excluded.memory_total_bytes,"
        " memory_free_bytes = excluded.memory_free_bytes, cpu_load = excluded.cpu_load,"
        " version = excluded.version",
        (
            n.id,
            n.address,
            n.started_at.isoformat(),
            n.heartbeat_at.isoformat(),
            n.lease_expires_at.isoformat(),
            int(n.draining),
            n.sessions,
            n.memory_total_bytes,
            n.memory_free_bytes,
            n.cpu_load,
            n.version,
        ),
    )


def list_nodes() -> Op[list[NodeInfo]]:
    rows = yield Query(f"SELECT {_COLUMNS} FROM nodes ORDER BY id")
    return [_node(r) for r in rows]


def get_node(node_id: str) -> Op[NodeInfo | None]:
    rows = yield Query(f"SELECT {_COLUMNS} FROM nodes WHERE id = ?", (node_id,))
    return _node(rows[0]) if rows else None


def set_draining(node_id: str, draining: bool) -> Op[bool]:
    changed = yield Query(
        "UPDATE nodes SET draining = ? WHERE id = ?", (int(draining), node_id), rowcount=True
    )
    return bool(changed[0][0])


def delete_node(node_id: str) -> Op[bool]:
    changed = yield Query("DELETE FROM nodes WHERE id = ?", (node_id,), rowcount=True)
    return bool(changed[0][0])


def sessions_on(node_id: str) -> Op[list[StoredSession]]:
    """The live sessions whose row names ``node_id``."""
    rows = yield Query(
        f"SELECT {SESSION_COLUMNS} FROM sessions WHERE node = ? AND deleted_at IS NULL"
        " AND state NOT IN ('dead', 'deleted') ORDER BY created_at",
        (node_id,),
    )
    return [session_of(r) for r in rows]


def claim_session(
    session_id: str, from_node: str | None, to_node: str | None, expires_at: datetime | None
) -> Op[bool]:
    """Move a session's row from ``from_node`` to ``to_node`` (None: no node, e.g. while
    hibernated) only if it still names ``from_node``: of two sweepers racing to restore a
    lost node's session, exactly one wins."""
    changed = yield Query(
        "UPDATE sessions SET node = ?, lease_expires_at = ? WHERE id = ? AND node IS ?",
        (to_node, expires_at.isoformat() if expires_at else None, session_id, from_node),
        postgres="UPDATE sessions SET node = ?, lease_expires_at = ? WHERE id = ?"
        " AND node IS NOT DISTINCT FROM ?",
        rowcount=True,
    )
    return bool(changed[0][0])
