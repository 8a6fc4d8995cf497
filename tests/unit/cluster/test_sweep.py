"""The node-loss sweep's planner and adoption's pure parts, tested with data."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kernelhub.cluster.adopt import lost_executions
from kernelhub.cluster.models import NodeInfo
from kernelhub.cluster.sweep import Take, plan
from kernelhub.models import ExecutionStatus
from kernelhub.store.records import StoredSession

NOW = datetime(2026, 12, 2, 4, 0, tzinfo=UTC)


def node(nid: str, *, expires: float = 5.0, draining: bool = False, sessions: int = 0) -> NodeInfo:
    """``expires``: seconds from NOW its lease runs out (negative: lost that long ago)."""
    return NodeInfo(
        id=nid, address=f"https://{nid}:8766", started_at=NOW - timedelta(hours=1),
        heartbeat_at=NOW, lease_expires_at=NOW + timedelta(seconds=expires),
        draining=draining, sessions=sessions,
    )  # fmt: skip


def session(sid: str, on: str | None, state: str = "ready", age: float = 0.0) -> StoredSession:
    return StoredSession(
        id=sid, owner="alice", backend="docker", state=state,
        created_at=NOW - timedelta(minutes=10, seconds=-age), limits={}, metadata={},
        reason=None, deleted_at=None, node=on,
    )  # fmt: skip


def adopted(takes: list[Take]) -> list[str]:
    return [t.session_id for t in takes if t.kind == "adopt"]


def test_a_lost_nodes_sessions_are_spread_over_the_survivors() -> None:
    nodes = [node("a", expires=-1), node("b"), node("c")]
    orphans = [session(f"s{i}", "a", age=i) for i in range(6)]
    b = plan(nodes, orphans, "b", NOW, grace=10)
    c = plan(nodes, orphans, "c", NOW, grace=10)
    assert len(adopted(b)) == len(adopted(c)) == 3
    assert set(adopted(b)) | set(adopted(c)) == {f"s{i}" for i in range(6)}
    assert not set(adopted(b)) & set(adopted(c))
    assert all(t.from_node == "a" for t in b + c)


def test_the_least_loaded_survivor_takes_more() -> None:
    nodes = [node("a", expires=-1), node("b", sessions=4), node("c", sessions=0)]
    orphans = [session(f"s{i}", "a", age=i) for i in range(6)]
    # c takes the first four (up to b's load), then they alternate: c 5, b 1.
    assert len(adopted(plan(nodes, orphans, "c", NOW, grace=10))) == 5
    assert len(adopted(plan(nodes, orphans, "b", NOW, grace=10))) == 1


def test_hibernated_sessions_only_lose_their_node() -> None:
    nodes = [node("a", expires=-1), node("b"), node("c")]
    takes = plan(nodes, [session("h", "a", "hibernated")], "b", NOW, grace=10)
    assert takes == [Take("h", "a", "release")]
    assert plan(nodes, [session("d", "a", "dead")], "b", NOW, grace=10) == []


def test_a_live_nodes_sessions_are_left_alone() -> None:
    nodes = [node("a", expires=0.5), node("b")]
    assert plan(nodes, [session("s", "a")], "b", NOW, grace=10) == []


def test_a_draining_or_lost_node_takes_nothing() -> None:
    orphans = [session("s", "a")]
    assert (
        plan([node("a", expires=-1), node("b", draining=True)], orphans, "b", NOW, grace=10) == []
    )
    assert plan([node("a", expires=-1), node("b", expires=-0.1)], orphans, "b", NOW, grace=10) == []
    assert plan([node("a", expires=-1)], orphans, "b", NOW, grace=10) == []  # b never beat


def test_past_the_grace_any_survivor_takes_what_its_assignee_left() -> None:
    nodes = [node("a", expires=-30), node("b"), node("c")]
    orphans = [session("s0", "a"), session("s1", "a", age=1)]
    assert adopted(plan(nodes, orphans, "b", NOW, grace=60)) == ["s0"]
    assert adopted(plan(nodes, orphans, "b", NOW, grace=20)) == ["s0", "s1"]


def test_a_session_of_a_node_with_no_row_counts_once_its_own_lease_ran_out() -> None:
    nodes = [node("b")]
    gone = session("s", "vanished").model_copy(
        update={"lease_expires_at": NOW - timedelta(seconds=1)}
    )
    held = session("t", "vanished").model_copy(
        update={"lease_expires_at": NOW + timedelta(seconds=1)}
    )
    assert adopted(plan(nodes, [gone, held, gone], "b", NOW, grace=10)) == ["s"]


def test_lost_executions_are_those_after_the_checkpoint() -> None:
    S = ExecutionStatus
    rows = [("e1", S.COMPLETED, 1), ("e2", S.COMPLETED, 2), ("e3", S.FAILED, 3),
            ("e4", S.RUNNING, None), ("e5", S.QUEUED, None), ("e6", S.CANCELLED, None)]  # fmt: skip
    assert lost_executions(rows, after=2) == ["e3", "e4"]
    assert lost_executions(rows, after=None) == ["e1", "e2", "e3", "e4"]
