"""Placement with data: least loaded by memory, then sessions, then CPU; draining and lost
nodes skipped; a burst of creates between two heartbeats spread; every refusal says why."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kernelhub.cluster.models import NodeInfo
from kernelhub.cluster.placement import Placed, choose, with_placed
from kernelhub.errors import NodeUnavailableError

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
GiB = 2**30
MiB = 2**20


def node(id: str, *, free: int = 8 * GiB, sessions: int = 0, cpu: float = 0.1,
         draining: bool = False, lease: float = 10.0, beat: float = -1.0) -> NodeInfo:  # fmt: skip
    return NodeInfo(
        id=id,
        address=f"https://{id}:8766",
        started_at=NOW - timedelta(hours=1),
        heartbeat_at=NOW + timedelta(seconds=beat),
        lease_expires_at=NOW + timedelta(seconds=lease),
        draining=draining,
        sessions=sessions,
        memory_total_bytes=16 * GiB,
        memory_free_bytes=free,
        cpu_load=cpu,
    )


def test_most_memory_free_wins_then_fewest_sessions_then_least_cpu() -> None:
    assert choose([node("a", free=2 * GiB), node("b", free=6 * GiB)], NOW).id == "b"
    assert choose([node("a", sessions=3), node("b", sessions=1)], NOW).id == "b"
    assert choose([node("a", cpu=0.9), node("b", cpu=0.2)], NOW).id == "b"
    # Memory first: more sessions but far more room still wins.
    assert (
        choose([node("a", free=GiB, sessions=0), node("b", free=8 * GiB, sessions=5)], NOW).id
        == "b"
    )


def test_memory_noise_below_a_slot_does_not_outvote_a_session() -> None:
    # Two nodes on one machine read its free memory a few MB apart.
    a = node("a", free=8 * GiB + 40 * MiB, sessions=2)
    b = node("b", free=8 * GiB, sessions=1)
    assert choose([a, b], NOW, memory_bytes=512 * MiB).id == "b"


def test_draining_and_lost_nodes_take_nothing() -> None:
    nodes = [node("a", draining=True, free=16 * GiB), node("b", lease=-1, free=16 * GiB), node("c")]
    assert choose(nodes, NOW).id == "c"


@pytest.mark.parametrize(
    ("nodes", "said"),
    [
        ([], "no node agent has registered"),
        ([node("a", lease=-5), node("b", lease=-1)], "no node agent is alive: all 2"),
        (
            [node("a", draining=True), node("b", draining=True)],
            "every live node is draining (a, b)",
        ),
        ([node("a", free=100 * MiB)], "no node has 536870912 bytes free"),
    ],
)
def test_no_node_can_take_it_is_a_typed_refusal_naming_why(
    nodes: list[NodeInfo], said: str
) -> None:
    with pytest.raises(
        NodeUnavailableError, match=r"^" + said.replace("(", r"\(").replace(")", r"\)")
    ):
        choose(nodes, NOW, memory_bytes=512 * MiB)


def test_a_burst_between_heartbeats_spreads_over_the_nodes() -> None:
    nodes = [node("a"), node("b"), node("c")]
    placed: list[Placed] = []
    for i in range(6):
        chosen = choose(nodes, NOW, memory_bytes=512 * MiB, placed=placed)
        placed.append(Placed(chosen.id, NOW + timedelta(milliseconds=i), 512 * MiB))
    assert sorted(p.node for p in placed) == ["a", "a", "b", "b", "c", "c"]


def test_placements_a_heartbeat_already_counted_are_not_counted_twice() -> None:
    fresh = node("a", sessions=1, beat=+1.0)  # beat after the placement
    stale = node("b", sessions=1, beat=-1.0)  # beat before it
    placed = [Placed("a", NOW, 512 * MiB), Placed("b", NOW, 512 * MiB), Placed("gone", NOW, 1)]
    a, b = with_placed([fresh, stale], placed)
    assert (a.sessions, a.memory_free_bytes) == (1, 8 * GiB)
    assert (b.sessions, b.memory_free_bytes) == (2, 8 * GiB - 512 * MiB)
