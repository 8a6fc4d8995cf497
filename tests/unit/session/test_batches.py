"""Batch runs without Docker: the pure parts with data, the store with a real SQLite file,
and the runner against a fake session manager (injected) whose "code" is a tiny script:
``ok``, ``raise``, ``hang`` (until interrupted) or ``stubborn`` (ignores interrupts)."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pydantic
import pytest

from kernelhub.config import Settings, StorageSettings, load_settings
from kernelhub.errors import (
    ConfigError,
    InvalidRequestError,
    NotFoundError,
    QuotaError,
    SessionError,
)
from kernelhub.models import EndedBy, Execution, ExecutionRecord, ExecutionStatus
from kernelhub.session.batch_item import BATCH_ID_KEY, BATCH_INDEX_KEY
from kernelhub.session.batches import (
    BatchRunner,
    batch_state,
    count_statuses,
    retry_after,
    wait_seconds,
)
from kernelhub.store.quota import StorageGuard, StorageLedger
from kernelhub.store.records import Principal, StoredBatch, StoredBatchItem, StoredExecution
from kernelhub.store.sqlite import SqliteStore
from kernelhub.wire import BatchCreate, BatchItemIn, BatchState, SessionInfo, SessionState
from tests.conftest import UNIT, eventually

Q, R, C = ExecutionStatus.QUEUED, ExecutionStatus.RUNNING, ExecutionStatus.COMPLETED
ALICE = Principal(name="alice")

# -- pure --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("statuses", "cancelled", "state"),
    [
        ([Q, Q], False, BatchState.QUEUED),
        ([Q, R], False, BatchState.RUNNING),
        ([C, Q], False, BatchState.RUNNING),
        ([C, ExecutionStatus.FAILED], False, BatchState.FINISHED),
        ([R, ExecutionStatus.CANCELLED], True, BatchState.CANCELLING),
        ([ExecutionStatus.INTERRUPTED, ExecutionStatus.CANCELLED], True, BatchState.CANCELLED),
        ([C, C], True, BatchState.CANCELLED),
    ],
)
def test_batch_state(statuses: list[ExecutionStatus], cancelled: bool, state: BatchState) -> None:
    assert batch_state(statuses, cancelled) == state


def test_counts_retry_after_and_wait() -> None:
    assert count_statuses([C, C, Q]) == {"completed": 2, "queued": 1}
    assert retry_after(8, 4, 5.0) == 10.0
    assert retry_after(1, 100, 0.1) == 1.0 and retry_after(10**6, 1, 60) == 600.0
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    item = StoredBatchItem(batch_id="b", index=0, owner="a", queued_at=t0)
    assert wait_seconds(item, t0 + timedelta(seconds=3)) == 3.0  # still waiting
    started = item.model_copy(update={"started_at": t0 + timedelta(seconds=1)})
    assert wait_seconds(started, t0 + timedelta(seconds=9)) == 1.0
    assert wait_seconds(item.model_copy(update={"duplicate_of": ("x", 0)}), t0) is None


@pytest.mark.parametrize(
    "files",
    [
        {"../etc/passwd": "eA=="},
        {"/abs": "eA=="},
        {"a//b": "eA=="},
        {"": "eA=="},
        {"ok.txt": "not base64!"},
    ],
)
def test_bad_item_files_are_refused(files: dict[str, str]) -> None:
    with pytest.raises(pydantic.ValidationError):
        BatchItemIn(code="1", files=files)


# -- the store ---------------------------------------------------------------------------


async def test_store_resolves_duplicates_and_releases_keys(tmp_path: Path) -> None:
    store = await SqliteStore.open(tmp_path / "s.sqlite3")
    try:
        now = datetime.now(UTC)

        def item(batch: str, n: int, key: str | None, owner: str = "alice") -> StoredBatchItem:
            return StoredBatchItem(
                batch_id=batch, index=n, owner=owner, idempotency_key=key, queued_at=now
            )

        first = await store.insert_batch(
            StoredBatch(id="b1", owner="alice", created_at=now, concurrency=2),
            [item("b1", 0, "k"), item("b1", 1, "k"), item("b1", 2, None)],
        )
        assert first[1].duplicate_of == ("b1", 0) and first[1].idempotency_key is None
        second = await store.insert_batch(
            StoredBatch(id="b2", owner="alice", created_at=now, concurrency=2),
            [item("b2", 0, "k"), item("b2", 1, "j")],
        )
        assert second[0].duplicate_of == ("b1", 0) and second[1].duplicate_of is None
        bob = await store.insert_batch(  # keys are per principal
            StoredBatch(id="b3", owner="bob", created_at=now, concurrency=1),
            [item("b3", 0, "k", owner="bob")],
        )
        assert bob[0].duplicate_of is None
        await store.update_batch_item("b1", 0, status=C, execution_id="e1", finished_at=now)
        items = await store.batch_items("b2")
        assert (items[0].status, items[0].execution_id) == (C, "e1")  # shows the first's
        assert await store.batch_statuses(["b1", "b2"]) == {"b1": [C, C, Q], "b2": [C, Q]}
        assert {(i.batch_id, i.index) for i in await store.unfinished_batch_items()} == {
            ("b1", 2),
            ("b2", 1),
            ("b3", 0),
        }
        assert await store.used_batch_keys("alice", ["k", "j", "z"]) == {"k", "j"}
        await store.update_batch_item("b2", 1, release_key=True)
        assert await store.used_batch_keys("alice", ["j"]) == set()
    finally:
        await store.close()


# -- the runner against a fake manager ---------------------------------------------------


class FakeHandle:
    def __init__(self, execution_id: str, code: str) -> None:
        self.id = execution_id
        self.code = code
        self.record: ExecutionRecord | None = None
        self.done = asyncio.Event()
        self.interrupted = False

    def finish(self, status: ExecutionStatus) -> None:
        now = datetime.now(UTC)
        self.record = ExecutionRecord(
            execution_id=self.id,
            status=status,
            ended_by=EndedBy.INTERRUPT if status == ExecutionStatus.INTERRUPTED else EndedBy.REPLY,
            queued_at=now,
            finished_at=now,
        )
        self.done.set()

    async def wait(self) -> Execution:
        await self.done.wait()
        assert self.record is not None
        return Execution(record=self.record, events=[])


class FakeManager:
    """The SessionManager's public methods the runner uses, with bookkeeping."""

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, Any]] = {}
        self.handles: dict[str, FakeHandle] = {}
        self.most_alive = 0
        self.created = 0
        self.refusals = 0  # QuotaErrors to answer before creating
        self.storage = StorageGuard(StorageSettings(min_free_bytes=0), StorageLedger(), Path())

    def resolve_limits(self, requested: Any) -> None:
        pass  # the real one is exercised by tests/gateway/test_batches.py

    async def create(self, principal: Principal, body: Any) -> SessionInfo:
        if self.refusals:
            self.refusals -= 1
            raise QuotaError("full", retry_after=0.01)
        await asyncio.sleep(0.01)
        sid = uuid.uuid4().hex[:16]
        self.created += 1
        self.sessions[sid] = {"owner": principal.name, "files": {}, "metadata": body.metadata}
        self.most_alive = max(self.most_alive, len(self.sessions))
        return self._info(sid)

    def _info(self, sid: str) -> SessionInfo:
        s = self.sessions[sid]
        return SessionInfo(
            id=sid, owner=s["owner"], state=SessionState.READY, backend="fake",
            created_at=datetime.now(UTC), limits={}, metadata=s["metadata"],
        )  # fmt: skip

    async def upload(
        self, principal: Principal, sid: str, path: str, chunks: AsyncIterator[bytes]
    ) -> int:
        data = b"".join([c async for c in chunks])
        self.sessions[sid]["files"][path] = data
        return len(data)

    async def submit(self, principal: Principal, sid: str, body: Any) -> Any:
        eid = uuid.uuid4().hex
        handle = FakeHandle(eid, body.code)
        self.handles[eid] = handle
        self.sessions[sid]["ran"] = eid
        if body.code == "ok":
            asyncio.get_running_loop().call_later(0.02, handle.finish, C)
        elif body.code == "raise":
            handle.finish(ExecutionStatus.FAILED)
        row = StoredExecution(
            id=eid, session_id=sid, owner=principal.name, code=body.code, status=Q,
            idempotency_key=None, created_at=datetime.now(UTC), record=None,
        )  # fmt: skip
        return row, handle, True

    async def settled(self, execution_id: str) -> None:
        pass

    async def execution(self, principal: Principal, execution_id: str) -> Any:
        h = self.handles.get(execution_id)
        if h is None:
            raise NotFoundError(f"no execution {execution_id!r}")
        row = StoredExecution(
            id=h.id, session_id="s", owner=principal.name, code=h.code,
            status=h.record.status if h.record else R, idempotency_key=None,
            created_at=datetime.now(UTC), record=h.record,
        )  # fmt: skip
        return row, []

    async def interrupt(self, principal: Principal, execution_id: str) -> None:
        h = self.handles[execution_id]
        h.interrupted = True
        if h.code == "hang":
            h.finish(ExecutionStatus.INTERRUPTED)

    async def cancel(self, principal: Principal, execution_id: str) -> None:
        raise SessionError("not queued")

    async def delete(self, principal: Principal, sid: str) -> None:
        s = self.sessions.pop(sid)
        assert s["owner"] == principal.name
        handle = self.handles.get(s.get("ran", ""))
        if handle is not None and handle.record is None:
            handle.finish(ExecutionStatus.KERNEL_DIED)

    async def list_sessions(self, principal: Principal, *, everyone: bool = False) -> Any:
        return [self._info(sid) for sid in self.sessions]


def batch_settings(tmp_path: Path, **batch: int) -> Settings:
    return load_settings(
        data_dir=tmp_path / "data",
        store={"node": "n1"},
        batch={"concurrency": 3, **batch},
        engine={"interrupt_grace": 0.05},
    )


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "kh.sqlite3")
    yield s
    await s.close()


def items(*codes: str, **extra: Any) -> BatchCreate:
    return BatchCreate(items=[BatchItemIn(code=c, **extra) for c in codes])


async def finished(runner: BatchRunner, batch_id: str) -> Any:
    """The batch once every item has ended (with results)."""
    async with asyncio.timeout(10 * UNIT):
        while True:
            info = await runner.info(ALICE, batch_id)
            if info.state in (BatchState.FINISHED, BatchState.CANCELLED):
                return info
            await asyncio.sleep(0.01)


async def test_runs_bounded_fresh_and_cleaned_up(tmp_path: Path, store: SqliteStore) -> None:
    fake = FakeManager()
    fake.refusals = 2  # the first creates meet a full gateway: the item waits, then runs
    runner = BatchRunner(batch_settings(tmp_path), fake, store)  # type: ignore[arg-type]
    await runner.start()
    data = base64.b64encode(b"x,y").decode()
    try:
        big = await runner.submit(ALICE, items(*["ok"] * 8, "raise", files={"in.csv": data}))
        small = await runner.submit(
            ALICE, BatchCreate(items=[BatchItemIn(code="ok")] * 3, concurrency=1)
        )
        done = await finished(runner, big.id)
        await finished(runner, small.id)
    finally:
        await runner.close()
    assert fake.most_alive <= 3 and fake.created == 12 and fake.sessions == {}
    assert done.counts == {"completed": 8, "failed": 1}
    assert len({i.session_id for i in done.items}) == 9
    assert all(i.result is not None and i.result.record is not None for i in done.items)
    assert runner.queue_length == 0 and runner.running == 0


async def test_a_principals_long_batch_leaves_room_for_anothers(
    tmp_path: Path, store: SqliteStore
) -> None:
    fake = FakeManager()
    runner = BatchRunner(batch_settings(tmp_path, concurrency=4), fake, store)  # type: ignore[arg-type]
    await runner.start()
    bob = Principal(name="bob")
    try:
        long = await runner.submit(ALICE, items(*["hang"] * 6))
        await eventually(lambda: runner.running == 2, 5)  # half the slots, not all four
        short = await runner.submit(bob, items(*["ok"] * 5))
        async with asyncio.timeout(10 * UNIT):
            while (await runner.info(bob, short.id)).state != BatchState.FINISHED:
                await asyncio.sleep(0.01)
        still = await runner.info(ALICE, long.id, results=False)
        assert still.counts == {"running": 2, "queued": 4}
        await runner.cancel(ALICE, long.id)
        await finished(runner, long.id)
    finally:
        await runner.close()


async def test_capacity_keys_and_access(tmp_path: Path, store: SqliteStore) -> None:
    fake = FakeManager()
    settings = batch_settings(tmp_path, max_queued_items=5, max_items=5, principal_concurrency=3)
    runner = BatchRunner(settings, fake, store)  # type: ignore[arg-type]
    await runner.start()
    try:
        with pytest.raises(InvalidRequestError, match="MAX_ITEMS"):
            await runner.submit(ALICE, items(*["ok"] * 6))
        with pytest.raises(InvalidRequestError, match="CONCURRENCY"):
            await runner.submit(ALICE, BatchCreate(items=[BatchItemIn(code="ok")], concurrency=4))
        hanging = await runner.submit(ALICE, items(*["hang"] * 5, idempotency_key=None))
        await eventually(lambda: runner.running == 3, 5)
        assert runner.queue_length == 2
        with pytest.raises(QuotaError) as refused:  # two wait; four more would be six
            await runner.submit(ALICE, items("ok", "ok", "ok", "ok"))
        assert refused.value.retry_after >= 1
        keyed = BatchCreate(
            items=[BatchItemIn(code="ok", idempotency_key=k) for k in ("a", "a", "b")]
        )
        first = await runner.submit(ALICE, keyed)  # two new items: fits
        assert first.items is not None and first.items[1].duplicate_of is not None
        again = await runner.submit(ALICE, keyed)  # nothing new: fits whatever waits
        assert again.items is not None and all(i.duplicate_of for i in again.items)
        with pytest.raises(NotFoundError):
            await runner.info(Principal(name="bob"), hanging.id)
        assert await runner.list_batches(Principal(name="bob")) == []
        await runner.cancel(ALICE, hanging.id)
        await finished(runner, first.id)
        await finished(runner, hanging.id)
    finally:
        await runner.close()
    assert fake.created == 5  # the three hanging ones and the two keyed ones


async def test_cancel_interrupts_and_stops_the_stubborn(tmp_path: Path, store: SqliteStore) -> None:
    fake = FakeManager()
    settings = batch_settings(tmp_path, principal_concurrency=3)
    runner = BatchRunner(settings, fake, store)  # type: ignore[arg-type]
    await runner.start()
    try:
        batch = await runner.submit(
            ALICE, items("hang", "stubborn", "hang", "ok", "ok", idempotency_key=None)
        )
        await eventually(lambda: len(fake.handles) == 3, 5)
        await runner.cancel(ALICE, batch.id)
        done = await finished(runner, batch.id)
    finally:
        await runner.close()
    assert [i.status.value for i in done.items] == [
        "interrupted", "cancelled", "interrupted", "cancelled", "cancelled",
    ]  # fmt: skip
    assert "did not stop" in done.items[1].error and fake.sessions == {}
    assert done.state == BatchState.CANCELLED


async def test_close_and_restart_leave_nothing_unrecorded(
    tmp_path: Path, store: SqliteStore
) -> None:
    fake = FakeManager()
    settings = batch_settings(tmp_path, concurrency=1)
    runner = BatchRunner(settings, fake, store)  # type: ignore[arg-type]
    await runner.start()
    keyed = BatchCreate(
        items=[BatchItemIn(code=c, idempotency_key=k) for c, k in (("hang", "run"), ("ok", "wait"))]
    )
    batch = await runner.submit(ALICE, keyed)
    await eventually(lambda: len(fake.handles) == 1, 5)
    await runner.close()
    # The item whose code ran fails; the waiting one waits on, for any node.
    info = await runner.info(ALICE, batch.id)
    assert info.counts == {"failed": 1, "queued": 1} and fake.sessions == {}
    assert info.items is not None and "shut down while" in (info.items[0].error or "")
    assert await store.used_batch_keys("alice", ["run", "wait"]) == {"run", "wait"}

    # A process killed mid-item: its claims stand, one item's code had gone to a kernel
    # (its session lives on), the other's had not.
    now = datetime.now(UTC)
    await store.insert_batch(
        StoredBatch(id="gone", owner="alice", created_at=now, concurrency=2),
        [
            StoredBatchItem(
                batch_id="gone", index=n, owner="alice", idempotency_key=f"g{n}", queued_at=now,
                body=BatchItemIn(code="ok").model_dump_json(),
            )
            for n in range(2)
        ],
    )  # fmt: skip
    claim = await store.claim_batch_items(runner.node, 3, 60.0)
    assert [(i.batch_id, i.index) for i in claim.items] == [(batch.id, 1), ("gone", 0), ("gone", 1)]
    await store.update_batch_item("gone", 0, execution_id="e0", submitted_at=now)
    fake.sessions["left"] = {
        "owner": "alice",
        "files": {},
        "metadata": {BATCH_ID_KEY: "gone", BATCH_INDEX_KEY: 0},
    }
    fake.sessions["mine"] = {"owner": "alice", "files": {}, "metadata": {}}
    restarted = BatchRunner(settings, fake, store)  # type: ignore[arg-type]
    await restarted.start()
    try:
        gone = await finished(restarted, "gone")
        first = await finished(restarted, batch.id)
    finally:
        await restarted.close()
    assert gone.items is not None and [i.status for i in gone.items] == [
        ExecutionStatus.FAILED, C,
    ]  # fmt: skip
    assert "while its code ran" in (gone.items[0].error or "")
    assert first.counts == {"failed": 1, "completed": 1}
    assert list(fake.sessions) == ["mine"]
    assert await store.used_batch_keys("alice", ["g0", "g1"]) == {"g0", "g1"}


def test_a_lease_that_would_lapse_between_renewals_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KERNELHUB_BATCH__LEASE_TTL"):
        load_settings(data_dir=tmp_path, batch={"poll_interval": 20.0})


def node_settings(tmp_path: Path, node: str) -> Settings:
    return load_settings(
        data_dir=tmp_path / node,
        store={"node": node},
        batch={"concurrency": 2, "principal_concurrency": 2, "poll_interval": 0.05,
               "lease_ttl": 0.5},
        engine={"interrupt_grace": 0.05},
    )  # fmt: skip


async def test_nodes_share_one_queue_and_a_lost_nodes_items_run_once(
    tmp_path: Path, store: SqliteStore
) -> None:
    fakes = [FakeManager(), FakeManager()]
    a, b = (
        BatchRunner(node_settings(tmp_path, n), f, store)  # type: ignore[arg-type]
        for n, f in zip(("n1", "n2"), fakes, strict=True)
    )
    batch = await a.submit(ALICE, items(*["ok"] * 7))
    # Two nodes that claimed items and vanished: one before their code reached a kernel,
    # the other after (a batch's concurrency counts per node: 2 here).
    lost = await store.claim_batch_items("gone", 2, 0.5)
    assert [i.index for i in lost.items] == [0, 1]
    lost = await store.claim_batch_items("gone-too", 1, 0.5)
    assert [i.index for i in lost.items] == [2]
    await store.update_batch_item(batch.id, 2, submitted_at=datetime.now(UTC))
    await a.start()
    await b.start()
    try:
        done = await finished(b, batch.id)  # read through the node it was not sent to
    finally:
        await a.close()
        await b.close()
    assert done.items is not None
    assert [i.status for i in done.items] == [C, C, ExecutionStatus.FAILED, C, C, C, C]
    assert "(gone-too)" in (done.items[2].error or "")
    assert {i.node for i in done.items[3:]} == {"n1", "n2"}  # both worked the batch
    assert {i.node for i in done.items[:2]} <= {"n1", "n2"}  # the lost claims ran here
    assert sum(f.created for f in fakes) == 6  # each item once; the one that ran, never again
