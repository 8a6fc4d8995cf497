"""Where a new session goes (pure): the least loaded live node that takes sessions.

A gateway replica calls :func:`choose` for every create (and for a session whose row names
no node: a hibernated one wakes where placement puts it), with the nodes' heartbeat rows
and the placements it made itself since those rows were written (:class:`Placed`).
Without those, every create between two heartbeats would see the same "least loaded"
node and land on it: a burst of creates through one replica would pile up on one machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from kernelhub.cluster.models import NodeInfo
from kernelhub.errors import NodeUnavailableError


@dataclass(frozen=True)
class Placed:
    """A session this replica sent to ``node`` at ``at``, asking ``memory_bytes``."""

    node: str
    at: datetime
    memory_bytes: int


def with_placed(nodes: Sequence[NodeInfo], placed: Iterable[Placed]) -> list[NodeInfo]:
    """The nodes as they are once the placements their last heartbeat cannot know of yet
    (made after it) have landed: one more session each, that much less memory free."""
    by_id = {n.id: n for n in nodes}
    extra: dict[str, tuple[int, int]] = {}
    for p in placed:
        node = by_id.get(p.node)
        if node is None or p.at <= node.heartbeat_at:
            continue
        sessions, memory = extra.get(p.node, (0, 0))
        extra[p.node] = (sessions + 1, memory + p.memory_bytes)
    out = []
    for n in nodes:
        sessions, memory = extra.get(n.id, (0, 0))
        if sessions:
            n = n.model_copy(
                update={
                    "sessions": n.sessions + sessions,
                    "memory_free_bytes": max(0, n.memory_free_bytes - memory),
                }
            )
        out.append(n)
    return out


SLOT_BYTES = 256 * 2**20  # the unit free memory is compared in when a create asks none


def load_key(node: NodeInfo, memory_bytes: int = 0) -> tuple[int, int, float, str]:
    """Least loaded first: room for the most sandboxes of the size asked (free memory in
    whole slots: nodes on one machine read its free memory a few MB apart from moment to
    moment, and that noise must not outvote a session more), then the fewest sessions,
    then the least CPU load per core; the id breaks ties, so equal nodes are chosen in a
    stable order."""
    slots = node.memory_free_bytes // max(memory_bytes, SLOT_BYTES)
    return (-slots, node.sessions, node.cpu_load, node.id)


def choose(
    nodes: Sequence[NodeInfo],
    now: datetime,
    *,
    memory_bytes: int = 0,
    placed: Iterable[Placed] = (),
) -> NodeInfo:
    """The node a new session asking ``memory_bytes`` goes to, or
    :class:`NodeUnavailableError` saying why none can take it (none registered, all
    lost, all draining, none with the memory)."""
    if not nodes:
        raise NodeUnavailableError(
            "no node agent has registered with the store; start `kernelhub node` on a "
            "machine with the same KERNELHUB_STORE__URL"
        )
    alive = [n for n in nodes if n.alive(now)]
    if not alive:
        last = max(n.heartbeat_at for n in nodes)
        raise NodeUnavailableError(
            f"no node agent is alive: all {len(nodes)} missed their heartbeats (the last "
            f"beat at {last.isoformat(timespec='seconds')}); check `kernelhub node` on them"
        )
    open_ = [n for n in with_placed(alive, placed) if not n.draining]
    if not open_:
        raise NodeUnavailableError(
            f"every live node is draining ({', '.join(sorted(n.id for n in alive))}); "
            "undrain one or start another `kernelhub node`"
        )
    fits = [n for n in open_ if n.memory_free_bytes >= memory_bytes]
    if not fits:
        most = max(open_, key=lambda n: n.memory_free_bytes)
        raise NodeUnavailableError(
            f"no node has {memory_bytes} bytes free for a new sandbox (the most is "
            f"{most.memory_free_bytes} on {most.id}); ask for less memory, retry later or "
            "add a node",
            node=None,
        )
    return min(fits, key=lambda n: load_key(n, memory_bytes))
