"""The batch queue (store/batch_queue.py) on every backend: fair claims, claims that never
overlap, leases that lapse, and items that never run twice."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

import pytest

from kernelhub.models import ExecutionStatus
from kernelhub.store.postgres import PostgresStore
from kernelhub.store.records import StoredBatch, StoredBatchItem
from kernelhub.store.sql import SqlStore
from kernelhub.wire import BatchItemIn
from tests.conftest import UNIT
from tests.postgres import PostgresCluster
from tests.store.conftest import Opener
from tests.store.rows import NOW, execution, record, session

BODY = BatchItemIn(code="print(1)").model_dump_json()
LEASE = 30.0


async def add_batch(
    store: SqlStore,
    batch_id: str,
    owner: str,
    items: int,
    *,
    concurrency: int = 100,
    at: datetime = NOW,
    keys: bool = False,
) -> None:
    await store.insert_batch(
        StoredBatch(id=batch_id, owner=owner, created_at=at, concurrency=concurrency),
        [
            StoredBatchItem(
                batch_id=batch_id, index=n, owner=owner, queued_at=at, body=BODY,
                idempotency_key=f"{batch_id}-{n}" if keys else None,
            )
            for n in range(items)
        ],
    )  # fmt: skip


async def claim(
    store: SqlStore, node: str, limit: int, *, now: datetime = NOW, cap: int | None = None
) -> list[tuple[str, int]]:
    got = await store.claim_batch_items(node, limit, LEASE, principal_limit=cap, now=now)
    return [(i.batch_id, i.index) for i in got.items]


async def test_a_principal_with_a_thousand_items_does_not_starve_one_with_two(
    store: SqlStore,
) -> None:
    await add_batch(store, "big", "alice", 1000)
    await add_batch(store, "small", "bob", 2, at=NOW + timedelta(seconds=1))
    # Turns by fewest running: alice (older batch) and bob alternate while bob has items.
    first = await claim(store, "n1", 4)
    assert first == [("big", 0), ("big", 1), ("small", 0), ("small", 1)], first
    assert (await store.claim_batch_items("n1", 0, LEASE, now=NOW)).waiting == 998
    # Counted across the cluster: carol, with none running anywhere, goes first on n2.
    await add_batch(store, "late", "carol", 3, at=NOW + timedelta(seconds=2))
    assert await claim(store, "n2", 3) == [("late", 0), ("late", 1), ("big", 2)]
    assert await claim(store, "n1", 2) == [("late", 2), ("big", 3)]
    items = await store.batch_items("small")
    assert [(i.status, i.node) for i in items] == [(ExecutionStatus.RUNNING, "n1")] * 2
    assert all(i.started_at == NOW for i in items)


async def test_caps_a_batch_and_a_principal_per_node(store: SqlStore) -> None:
    await add_batch(store, "b", "alice", 6, concurrency=2)
    await add_batch(store, "c", "alice", 5)
    assert await claim(store, "n1", 3, cap=2) == [("b", 0), ("b", 1)]  # the principal's cap
    assert await claim(store, "n1", 3, cap=3) == [("c", 0)]  # b has its 2 on n1
    assert await claim(store, "n2", 3) == [("b", 2), ("b", 3), ("c", 1)]  # and 2 on n2
    await store.update_batch_item("b", 0, status=ExecutionStatus.COMPLETED, finished_at=NOW)
    assert await claim(store, "n1", 1) == [("b", 4)]
    assert await claim(store, "n1", 5, cap=3) == []  # n1 runs b 1, b 4 and c 0


async def test_claimers_take_disjoint_items_and_all_of_them(opener: Opener) -> None:
    a, b = await opener(), await opener()
    try:
        for n in range(4):
            await add_batch(a, f"b{n}", f"p{n % 2}", 25, at=NOW + timedelta(seconds=n))
        taken: dict[str, list[tuple[str, int]]] = {}

        async def drain(store: SqlStore, node: str) -> None:
            taken[node] = []
            while got := await claim(store, node, 3):
                taken[node] += got

        await asyncio.gather(*(drain(s, f"{s is a}-{n}") for s in (a, b) for n in range(2)))
        every = [i for claims in taken.values() for i in claims]
        assert len(every) == len(set(every)) == 100  # none twice, none left
        rows = await b.batch_items("b3")
        assert {r.node for r in rows} <= set(taken) and None not in {r.node for r in rows}
    finally:
        await a.close()
        await b.close()


@pytest.mark.postgres
async def test_items_being_claimed_elsewhere_are_skipped_not_waited_for(
    postgres_cluster: PostgresCluster,
) -> None:
    import psycopg

    url = postgres_cluster.fresh_url()
    store = await PostgresStore.open(url, node="n1")
    try:
        await add_batch(store, "held", "alice", 3)
        await add_batch(store, "free", "bob", 2, at=NOW + timedelta(seconds=1))
        async with await psycopg.AsyncConnection.connect(url) as other:
            async with other.transaction():  # another node, mid-claim on all of "held"
                await other.execute(
                    "SELECT idx FROM batch_items WHERE batch_id = 'held' FOR UPDATE"
                )
                got = await asyncio.wait_for(claim(store, "n1", 4), 5 * UNIT)
                assert got == [("free", 0), ("free", 1)]
            async with other.transaction():  # and on one item of it
                await other.execute(
                    "SELECT idx FROM batch_items WHERE batch_id = 'held' AND idx = 0 FOR UPDATE"
                )
                got = await asyncio.wait_for(claim(store, "n2", 4), 5 * UNIT)
                assert got == [("held", 1), ("held", 2)]
        assert await claim(store, "n2", 4) == [("held", 0)]
    finally:
        await store.close()


async def test_a_lapsed_lease_returns_the_item_and_a_started_one_never_runs_again(
    store: SqlStore,
) -> None:
    await add_batch(store, "b", "alice", 4, keys=True)
    assert await claim(store, "n1", 4) == [("b", 0), ("b", 1), ("b", 2), ("b", 3)]
    # Item 1 finished; 2's code went to a kernel and finished; 3's went and did not.
    await store.update_batch_item("b", 1, status=ExecutionStatus.COMPLETED, finished_at=NOW)
    await store.insert_session(session("s1"))
    for idx, eid in ((2, "e2"), (3, "e3")):
        await store.insert_execution(execution(eid))
        await store.update_batch_item("b", idx, execution_id=eid, submitted_at=NOW)
    await store.update_execution("e2", ExecutionStatus.COMPLETED, record("e2"))
    renewed = await store.renew_batch_items("n1", NOW + timedelta(seconds=LEASE))
    assert sorted((h.index, h.cancelled) for h in renewed) == [(0, False), (2, False), (3, False)]
    # Before the lease ends nothing moves; after it, n2 takes the one that never started.
    assert await claim(store, "n2", 4, now=NOW + timedelta(seconds=LEASE - 1)) == []
    later = NOW + timedelta(seconds=LEASE + 1)
    assert await claim(store, "n2", 4, now=later) == [("b", 0)]
    items = await store.batch_items("b")
    assert [(i.status.value, i.node) for i in items] == [
        ("running", "n2"), ("completed", "n1"), ("completed", "n1"), ("failed", "n1"),
    ]  # fmt: skip
    assert items[2].error is None and "while its code ran" in (items[3].error or "")
    assert await store.used_batch_keys("alice", ["b-3"]) == {"b-3"}  # it may have run
    # n1 comes back: its claim lapsed, so its late outcome for item 0 is not written.
    assert not await store.update_batch_item("b", 0, status=ExecutionStatus.FAILED, claimed_by="n1")
    assert await store.update_batch_item("b", 0, status=ExecutionStatus.COMPLETED, claimed_by="n2")
    # Nothing finished ever returns, however late.
    much_later = later + timedelta(days=1)
    assert await claim(store, "n3", 4, now=much_later) == []
    assert [i.status.value for i in await store.batch_items("b")] == [
        "completed", "completed", "completed", "failed",
    ]  # fmt: skip


async def test_cancel_reaches_waiting_running_and_lapsed_items(store: SqlStore) -> None:
    await add_batch(store, "b", "alice", 4, keys=True)
    await claim(store, "n1", 1)
    await claim(store, "n2", 1)
    assert await store.cancel_queued_batch_items("b") == 2
    assert await claim(store, "n3", 4) == []
    assert [h.cancelled for h in await store.renew_batch_items("n1", NOW)] == [True]
    # n1 and n2 are lost before their items started: those end cancelled, never queued.
    await claim(store, "n3", 4, now=NOW + timedelta(seconds=LEASE + 1))
    items = await store.batch_items("b")
    assert [(i.status.value, i.node) for i in items] == [
        ("cancelled", "n1"), ("cancelled", "n2"), ("cancelled", None), ("cancelled", None),
    ]  # fmt: skip
    assert await store.used_batch_keys("alice", ["b-0", "b-1", "b-2", "b-3"]) == set()


async def test_a_stopping_node_releases_its_claims(store: SqlStore) -> None:
    await add_batch(store, "b", "alice", 3)
    await claim(store, "n1", 2)
    await claim(store, "n2", 1)
    await store.update_batch_item("b", 1, execution_id="e1", submitted_at=NOW)
    assert await store.release_batch_items("n1") == 2
    assert [(i.status.value, i.node) for i in await store.batch_items("b")] == [
        ("queued", None), ("failed", "n1"), ("running", "n2"),
    ]  # fmt: skip
    assert await store.waiting_batch_items() == 1
    assert await claim(store, "n2", 3) == [("b", 0)]
