"""The Store contract (store/base.py), run against every backend (see conftest.py)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from kernelhub.cluster.models import NodeInfo
from kernelhub.config import StorageSettings
from kernelhub.errors import ConfigError, StoreConflictError, StoreError
from kernelhub.models import ExecutionStatus, StatusEvent
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store import migrations
from kernelhub.store.base import Store
from kernelhub.store.postgres import PostgresStore
from kernelhub.store.records import (
    AuditEntry,
    EgressGrants,
    StoredBatch,
    StoredBatchItem,
    StoredSnapshot,
)
from kernelhub.store.retention import RetentionSweeper
from kernelhub.store.sql import SqlStore
from tests.postgres import PostgresCluster
from tests.store.conftest import Opener
from tests.store.rows import (
    NOW,
    execution,
    record,
    scan,
    scanned_usage,
    session,
    statement,
    stream,
)


async def test_node_agents_beat_drain_and_race_for_a_lost_nodes_sessions(store: Store) -> None:
    beat = NodeInfo(
        id="n1", address="https://127.0.0.2:8766", started_at=NOW, heartbeat_at=NOW,
        lease_expires_at=NOW + timedelta(seconds=10), sessions=1, memory_total_bytes=8 << 30,
        memory_free_bytes=6 << 30, cpu_load=0.25, version="1",
    )  # fmt: skip
    await store.upsert_node(beat)
    await store.upsert_node(beat.model_copy(update={"id": "n2", "address": "https://b:1"}))
    assert await store.set_draining("n2", True) and not await store.set_draining("nx", True)
    later = NOW + timedelta(seconds=5)
    await store.upsert_node(beat.model_copy(update={"id": "n2", "heartbeat_at": later}))
    nodes = await store.list_nodes()
    assert [(x.id, x.draining) for x in nodes] == [("n1", False), ("n2", True)]  # beat kept it
    assert nodes[0] == beat and nodes[1].heartbeat_at == later
    assert nodes[0].alive(NOW) and not nodes[0].alive(NOW + timedelta(seconds=11))
    await store.insert_session(session("s1"))
    assert [s.id for s in await store.sessions_on("n1")] == ["s1"]
    until = NOW + timedelta(seconds=30)
    wins = await asyncio.gather(
        *(store.claim_session("s1", "n1", to, until) for to in ("n2", "n3"))
    )
    assert sorted(wins) == [False, True]  # exactly one sweeper takes it
    moved = await store.get_session("s1")
    assert moved is not None and moved.node in ("n2", "n3") and moved.lease_expires_at == until
    assert await store.claim_session("s1", moved.node, None, None)  # hibernated: no node
    assert await store.claim_session("s1", None, "n1", until)
    assert await store.get_node("n2") == nodes[1] and await store.get_node("nx") is None
    assert await store.delete_node("n2") and [x.id for x in await store.list_nodes()] == ["n1"]


async def test_sessions_carry_their_node_and_a_lease(store: Store) -> None:
    await store.insert_session(session("s1"))
    await store.insert_session(session("s2").model_copy(update={"node": "n2"}))
    got = await store.get_session("s1")
    assert got is not None and got.node == "n1" and got.limits == {"a": 1}
    assert got.lease_expires_at is None and got.metadata == {"m": "x"}
    assert await store.renew_leases("n1", NOW + timedelta(seconds=30)) == 1
    assert await store.expired_leases(NOW) == []
    late = await store.expired_leases(NOW + timedelta(seconds=31))
    assert [s.id for s in late] == ["s1"]
    await store.update_session("s2", state="hibernated", hibernation="snap1")
    hibernated = await store.get_session("s2")
    assert hibernated is not None and hibernated.hibernation == "snap1"
    await store.update_session("s2", state="ready")  # any other state clears it
    assert (await store.get_session("s2")).hibernation is None  # type: ignore[union-attr]
    await store.update_session("s1", state="dead", reason="oom")
    assert await store.expired_leases(NOW + timedelta(seconds=31)) == []  # dead: nothing to take
    await store.update_session("s2", state="deleted", deleted=True)
    assert [s.id for s in await store.list_sessions("alice")] == ["s1"]
    every = await store.list_sessions(include_deleted=True)
    assert [(s.id, s.state, s.reason) for s in every] == [
        ("s1", "dead", "oom"), ("s2", "deleted", None)
    ]  # fmt: skip
    assert every[1].deleted_at is not None


async def test_sessions_keep_their_tier_policy_and_egress_answers_across_a_reopen(
    store: SqlStore, opener: Opener
) -> None:
    tier = {"profile": "untrusted", "runtime": "runsc", "egress_policy": "strict"}
    await store.insert_session(
        session("s1").model_copy(update={**tier, "egress_grants": EgressGrants()})
    )
    await store.insert_session(session("s2"))  # as made before v6: nothing recorded
    grants = EgressGrants(granted=[("ask.example", 443)], denied=[("no.example", 80)])
    await store.set_egress_grants("s1", grants)
    await store.close()
    again = await opener()
    try:
        s1, s2 = await again.get_session("s1"), await again.get_session("s2")
        assert s1 is not None and s2 is not None
        assert (s1.profile, s1.runtime, s1.egress_policy) == ("untrusted", "runsc", "strict")
        assert s1.egress_grants == grants
        assert (s2.profile, s2.runtime, s2.egress_policy, s2.egress_grants) == (None,) * 4
        listed = {s.id: s for s in await again.list_sessions("alice")}
        assert listed["s1"].egress_grants == grants
    finally:
        await again.close()


async def test_writes_are_queued_when_called_and_reads_see_them(store: SqlStore) -> None:
    seen: list[object] = []
    store.insert_session(session("s1"))  # not awaited: still first
    row = store.insert_execution(execution("e1"), lambda error: seen.append(("row", error)))
    store.append_event("s1", 1, "e1", stream(1), lambda error: seen.append(("event", error)))
    got = await store.get_execution("e1")  # the read commits what was queued before it
    assert got is not None and seen == [("row", None), ("event", None)]
    assert (await row).id == "e1" and await store.last_seq("s1") == 1


async def test_a_write_that_may_wait_rides_with_the_next_and_flush_ends_the_wait(
    store: SqlStore,
) -> None:
    await store.insert_session(session("s1"))
    committed: list[int] = []
    store.append_event("s1", 1, "e1", stream(1), lambda e: committed.append(1), wait=5.0)
    number = store.pending_commit
    await asyncio.sleep(0.05)
    assert committed == [] and store.pending_commit == number  # waiting for company
    store.append_event("s1", 2, "e1", stream(2), lambda e: committed.append(2))
    assert store.pending_commit == number  # the same commit
    await asyncio.sleep(0.05)
    assert committed == [1, 2] and store.pending_commit is None
    store.append_event("s1", 3, "e1", stream(3), lambda e: committed.append(3), wait=5.0)
    await asyncio.wait_for(store.flush(), 2)
    assert committed == [1, 2, 3]


async def test_idempotency_keys_return_the_first_execution(store: Store) -> None:
    await store.insert_session(session("s1"))
    first = await store.insert_execution(execution("e1", key="k"))
    again = await store.insert_execution(execution("e2", key="k"))
    assert first.id == again.id == "e1"
    assert (await store.execution_by_key("alice", "k")) == first
    assert await store.get_execution("e2") is None


async def test_executions_finish_with_their_audit_entry_and_exports_keep_order(
    store: Store,
) -> None:
    await store.insert_session(session("s1"))
    for eid in ("e1", "e2", "e3"):
        await store.insert_execution(execution(eid))
    await store.update_execution("e1", ExecutionStatus.RUNNING)
    await store.finish_execution(record("e2"), AuditEntry(principal="alice", action="execution",
                                                          session_id="s1", code="é" * 100))  # fmt: skip
    assert [e.id for e in await store.unfinished_executions("s1")] == ["e1", "e3"]
    assert [e.id for e in await store.executions_of("s1")] == ["e1", "e2", "e3"]
    done = await store.get_execution("e2")
    assert done is not None and done.record == record("e2")
    assert done.status == ExecutionStatus.COMPLETED
    rows = await store.audit_log("s1")
    assert rows[0]["code"] == "é" * 32 and rows[0]["code_bytes"] == 200  # bounded, counted
    await store.audit(AuditEntry(principal="bob", action="token.create", detail={"x": "Needle"}))
    assert [r["principal"] for r in await store.audit_log(text="needle")] == ["bob"]
    page = await store.audit_log(limit=1)
    assert [r["action"] for r in page] == ["token.create"]
    assert [r["action"] for r in await store.audit_log(limit=5, before=page[0]["id"])] == [
        "execution"
    ]


async def test_events_page_by_count_and_bytes_and_a_seq_stored_twice_counts_once(
    store: Store,
) -> None:
    await store.insert_session(session("s1"))
    await store.insert_execution(execution("e1"))
    running = StatusEvent(execution_id="e1", seq=1, status=ExecutionStatus.RUNNING)
    assert not await store.has_started("e1")
    await store.append_event("s1", 1, "e1", running.model_dump_json())
    for seq in range(2, 12):
        store.append_event("s1", seq, "e1", stream(seq, text="y" * 100))
    await store.append_event("s1", 12, "", stream(12, eid=""))
    before = store.ledger.usage("alice")
    await store.append_event("s1", 5, "e1", stream(5, text="other"))  # a retried commit
    assert store.ledger.usage("alice") == before
    assert await store.has_started("e1") and await store.last_seq("s1") == 12
    page = await store.events_since("s1", 0, limit=4)
    assert [seq for seq, _ in page] == [1, 2, 3, 4]
    small = await store.events_since("s1", 4, max_bytes=250)
    assert [seq for seq, _ in small] == [5, 6]  # at most about 250 bytes, at least one
    assert len(await store.events_of("e1")) == 11
    assert [e.seq for e in await store.session_events_of("s1")] == [12]


async def test_tokens_and_sign_ins_and_a_taken_name_fails_alone(store: Store) -> None:
    await store.insert_session(session("s1"))
    token = await store.create_token("ci", read_only=True, session_id="s1",
                                     expires_at=NOW + timedelta(hours=1), acts_for="alice")  # fmt: skip
    p = await store.principal_for(token)
    assert p is not None and (p.name, p.token, p.read_only, p.session_id) == (
        "alice", "ci", True, "s1"
    )  # fmt: skip
    neighbour = store.append_event("s1", 1, "", stream(1, eid=""))  # the same turn
    with pytest.raises(StoreConflictError, match="'ci'"):
        await store.create_token("ci")
    await neighbour  # not failed by the conflict
    sid, csrf, expires = await store.create_web_session(token, 3600)
    assert expires <= NOW + timedelta(hours=1)
    signed = await store.web_session(sid)
    assert signed is not None and signed[1] == csrf and signed[0].name == "alice"
    assert [t.name for t in await store.list_tokens()] == ["ci"]
    assert await store.revoke_token("ci") and not await store.revoke_token("ci")
    assert await store.principal_for(token) is None and await store.web_session(sid) is None


async def test_batches_mark_duplicate_keys_and_resolve_them_to_the_first(store: Store) -> None:
    def item(batch: str, index: int, key: str | None) -> StoredBatchItem:
        return StoredBatchItem(batch_id=batch, index=index, owner="alice", idempotency_key=key,
                               queued_at=NOW)  # fmt: skip

    b1 = StoredBatch(id="b1", owner="alice", created_at=NOW, concurrency=2)
    stored = await store.insert_batch(b1, [item("b1", 0, "k"), item("b1", 1, "k")])
    assert stored[1].duplicate_of == ("b1", 0) and stored[1].idempotency_key is None
    assert await store.used_batch_keys("alice", ["k", "z"]) == {"k"}
    await store.update_batch_item("b1", 0, status=ExecutionStatus.RUNNING, execution_id="e9")
    items = await store.batch_items("b1")
    assert [(i.status, i.execution_id) for i in items] == [(ExecutionStatus.RUNNING, "e9")] * 2
    assert [i.index for i in await store.unfinished_batch_items()] == [0]
    await store.update_batch_item("b1", 0, status=ExecutionStatus.QUEUED, release_key=True)
    assert await store.used_batch_keys("alice", ["k"]) == set()
    await store.cancel_batch("b1")
    got = await store.get_batch("b1")
    assert got is not None and got.cancelled_at is not None
    assert [b.id for b in await store.list_batches("alice")] == ["b1"]
    assert await store.batch_statuses(["b1"]) == {"b1": [ExecutionStatus.QUEUED] * 2}


async def test_a_purge_removes_the_session_and_its_internal_snapshots_only(
    store: SqlStore, tmp_path: Path
) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    for sid in ("s1", "s2"):
        await store.insert_session(session(sid))
        await store.insert_execution(execution(f"{sid}-e", sid))
        for seq in range(1, 40):
            store.append_event(sid, seq, f"{sid}-e", stream(seq, f"{sid}-e", "z" * 500))
    for snap_id, kind in (("hib", "hibernation"), ("mine", "snapshot")):
        blobs.path(snap_id).parent.mkdir(parents=True, exist_ok=True)
        blobs.path(snap_id).write_bytes(b"blob")
        await store.insert_snapshot(StoredSnapshot(id=snap_id, session_id="s1", owner="alice",
            created_at=NOW, size=4, sha256="0", mac="0", metadata={"kind": kind}))  # fmt: skip
    assert store.ledger.usage("alice") == await scanned_usage(store, "alice") > 40_000
    await store.update_session("s1", state="deleted", deleted=True)
    await RetentionSweeper(store, blobs, StorageSettings(retention=0)).purge("s1")
    assert await store.get_session("s1") is None and await store.events_of("s1-e") == []
    assert store.ledger.usage("alice") == await scanned_usage(store, "alice") > 0
    assert [s.id for s in await store.list_snapshots("alice")] == ["mine"]
    assert not blobs.path("hib").exists() and blobs.path("mine").exists()
    assert await store.get_snapshot("mine") is not None
    await store.delete_snapshot("mine")
    assert await store.get_snapshot("mine") is None


async def test_the_schema_is_versioned_usage_survives_a_restart_and_newer_is_refused(
    store: SqlStore, opener: Opener
) -> None:
    await store.insert_session(session("s1"))
    await store.append_event("s1", 1, "", stream(1, eid=""))
    usage = store.ledger.usage("alice")
    assert await scan(store, "SELECT version FROM schema_version") == [(migrations.LATEST,)]
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.get_session("s1")
    again = await opener()  # migrating a database at the latest version changes nothing
    try:
        assert again.ledger.usage("alice") == usage > 0
        newer = migrations.LATEST + 1
        await again._alone(statement(f"UPDATE schema_version SET version = {newer}"))
    finally:
        await again.close()
    with pytest.raises(ConfigError, match="newer than this kernelhub"):
        await opener()


@pytest.mark.postgres
async def test_postgres_reconnects_after_losing_its_connection_and_says_so_when_it_cannot(
    postgres_cluster: PostgresCluster,
) -> None:
    import psycopg

    url = postgres_cluster.fresh_url()
    store = await PostgresStore.open(url)
    try:
        await store.insert_session(session("s1"))
        with psycopg.connect(url, autocommit=True) as admin:  # the server drops us
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE pid != pg_backend_pid() AND datname = current_database()"
            )
        with pytest.raises(StoreError, match=r"postgresql://kernelhub@.*failed"):
            await store.get_session("s1")  # the one that met the broken connection
        assert (await store.get_session("s1")) is not None  # the next one reconnected
    finally:
        await store.close()
    with pytest.raises(StoreError, match="cannot reach the store"):
        await PostgresStore.open("postgresql://nobody@/nowhere?host=/nonexistent")
