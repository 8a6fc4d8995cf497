"""The batch queue's planner (store/batch_queue.py::plan_claims), with data: whose items a
node takes when it has room."""

from __future__ import annotations

from kernelhub.store.batch_queue import OpenBatch, plan_claims


def b(id: str, owner: str, waiting: int, concurrency: int = 100, running: int = 0) -> OpenBatch:
    return OpenBatch(id=id, owner=owner, concurrency=concurrency, waiting=waiting, running=running)


def test_fewest_running_first_so_a_thousand_items_never_starve_two() -> None:
    batches = [b("big", "alice", 1000), b("small", "bob", 2)]
    assert plan_claims(batches, {}, {}, 4, None) == {"big": 2, "small": 2}
    assert plan_claims(batches, {}, {}, 1, None) == {"big": 1}  # a tie: the older batch
    assert plan_claims(batches, {"alice": 1}, {}, 1, None) == {"small": 1}
    # One slot at a time, as slots free up: bob's two go in the first three turns.
    running: dict[str, int] = {}
    turns = []
    left = {"big": 1000, "small": 2}
    for _ in range(6):
        open_ = [b(i, o, left[i]) for i, o in (("big", "alice"), ("small", "bob")) if left[i]]
        (got,) = plan_claims(open_, running, {}, 1, None)
        turns.append(got)
        left[got] -= 1
        owner = "alice" if got == "big" else "bob"
        running[owner] = running.get(owner, 0) + 1
    assert turns == ["big", "small", "big", "small", "big", "big"]


def test_counts_come_from_the_whole_cluster_and_the_cap_from_this_node() -> None:
    batches = [b("a1", "alice", 10), b("b1", "bob", 10), b("c1", "carol", 10)]
    # Alice runs 3 elsewhere, bob 1: carol first, then bob, then carol and bob alternate.
    assert plan_claims(batches, {"alice": 3, "bob": 1}, {}, 4, None) == {"c1": 2, "b1": 2}
    # This node already runs 2 of carol's: with a cap of 2 she gets none here.
    assert plan_claims(batches, {"carol": 2}, {"carol": 2}, 3, 2) == {"a1": 2, "b1": 1}


def test_a_batch_at_its_concurrency_gives_way_to_the_principals_next() -> None:
    batches = [b("x", "alice", 5, concurrency=2, running=1), b("y", "alice", 5)]
    assert plan_claims(batches, {"alice": 1}, {}, 4, None) == {"x": 1, "y": 3}
    full = [b("x", "alice", 5, concurrency=1, running=1)]
    assert plan_claims(full, {"alice": 1}, {}, 4, None) == {}


def test_never_more_than_the_limit_or_the_waiting() -> None:
    batches = [b("x", "alice", 2), b("y", "bob", 1)]
    assert plan_claims(batches, {}, {}, 10, None) == {"x": 2, "y": 1}
    assert plan_claims(batches, {}, {}, 0, None) == {}
    assert plan_claims([], {}, {}, 5, None) == {}
