"""The batch scheduler's turns, with data: who starts next under every cap."""

from __future__ import annotations

import pytest

from kernelhub.session.fair_queue import FairQueue, principal_cap


def drain(q: FairQueue[str]) -> list[str]:
    """Every item that starts now, in order."""
    started = []
    while (due := q.next()) is not None:
        started.append(due[1])
    return started


def test_principals_take_turns_whatever_their_queue_length() -> None:
    q: FairQueue[str] = FairQueue(concurrency=4, per_principal=4)
    q.add("alice", "a1", [f"a{n}" for n in range(100)], cap=4)
    q.add("bob", "b1", ["b0", "b1"], cap=4)
    q.add("carol", "c1", ["c0"], cap=4)
    assert drain(q) == ["a0", "b0", "c0", "a1"]
    # Each slot that frees goes to the principal served least recently.
    q.done("c1")
    q.done("a1")
    assert drain(q) == ["b1", "a2"]
    q.done("b1")
    assert drain(q) == ["a3"]  # bob and carol have nothing left: alice may take it
    assert q.running == 4 and q.waiting == 96


def test_one_principal_never_holds_every_slot() -> None:
    q: FairQueue[str] = FairQueue(concurrency=4, per_principal=principal_cap(4, None))
    q.add("alice", "long", [f"a{n}" for n in range(10)], cap=4)
    assert drain(q) == ["a0", "a1"]  # two slots stay free for anyone else
    q.add("alice", "more", ["x"], cap=4)
    assert drain(q) == []  # the cap covers all of alice's batches
    q.add("bob", "short", ["b0", "b1", "b2"], cap=4)
    assert drain(q) == ["b0", "b1"]
    q.done("short")
    assert drain(q) == ["b2"]
    q.done("short")
    q.done("short")
    assert drain(q) == []  # free slots, but alice is at her cap
    q.done("long")
    assert drain(q) == ["a2"]


def test_a_batch_cap_lets_the_principals_next_batch_go() -> None:
    q: FairQueue[str] = FairQueue(concurrency=3, per_principal=3)
    q.add("alice", "narrow", ["n0", "n1"], cap=1)
    q.add("alice", "wide", ["w0", "w1", "w2"], cap=3)
    assert drain(q) == ["n0", "w0", "w1"]
    q.done("narrow")
    assert drain(q) == ["n1"]  # the older batch first once it has room again


def test_drop_and_done_forget_ended_batches() -> None:
    q: FairQueue[str] = FairQueue(concurrency=2, per_principal=2)
    q.add("alice", "a", ["a0", "a1", "a2"], cap=2)
    assert drain(q) == ["a0", "a1"]
    assert q.drop("a") == ["a2"] and q.waiting == 0
    assert q.drop("a") == []
    q.done("a")
    q.done("a")
    assert q.running == 0
    with pytest.raises(KeyError):
        q.done("a")  # ended and forgotten
    q.add("alice", "a", ["again"], cap=1)  # the id is free again
    assert drain(q) == ["again"]
    q.add("bob", "empty", [], cap=1)  # nothing to run: nothing kept
    assert q.drop("empty") == []
    with pytest.raises(ValueError, match="queued already"):
        q.add("alice", "a", ["x"], cap=1)


def test_caps() -> None:
    assert [principal_cap(c, None) for c in (1, 2, 3, 4, 9)] == [1, 1, 2, 2, 5]
    assert principal_cap(4, 4) == 4
    with pytest.raises(ValueError, match="at least 1"):
        FairQueue(concurrency=0, per_principal=1)
