"""The fan-out against a real SQLite store: events reach subscribers only once committed,
in order, across commits inline and on the store thread, and through a failed write."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kernelhub import jsonslices
from kernelhub.models import (
    DisplayEvent,
    EndedBy,
    ErrorEvent,
    ExecutionRecord,
    ExecutionStatus,
    StatusEvent,
    StreamEvent,
)
from kernelhub.replay import Replay, Verdict
from kernelhub.session.fanout import Published, SessionFanout, Subscriber, big_event
from kernelhub.store.queries import Op, Query
from kernelhub.store.records import AuditEntry
from kernelhub.store.sqlite import SqliteStore

SID = "s1"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "kh.sqlite3")
    yield s
    await s.close()


def statement(
    store: SqliteStore, sql: str, *, on_thread: bool = False
) -> asyncio.Future[list[object]]:
    """A raw statement through the store's one entry point, in order with its writes (on
    its thread if asked: as a big commit would run)."""

    def op() -> Op[object]:
        return (yield Query(sql))

    store._flush()
    return store._submit([op()], write=True, big=on_thread)


def event(seq: int, text: str = "x") -> StreamEvent:
    return StreamEvent(execution_id="e1", seq=seq, name="stdout", text=text)


async def take(sub: Subscriber, n: int) -> list[Published]:
    items = []
    for _ in range(n):
        item = await asyncio.wait_for(sub.get(), 5)
        assert item is not None
        items.append(item)
    return items


async def stored_seqs(store: SqliteStore) -> list[int]:
    return [seq for seq, _ in await store.events_since(SID, 0)]


async def test_subscribers_get_only_committed_events_in_order(store: SqliteStore) -> None:
    fanout = SessionFanout(SID, store)
    sub = fanout.subscribe(1 << 20)
    seen_in_store: list[list[int]] = []

    async def reader() -> list[int]:
        got = []
        for item in await take(sub, 5):
            seen_in_store.append(await stored_seqs(store))
            got.append(item.seq)
        return got

    task = asyncio.create_task(reader())
    for seq in range(1, 4):
        fanout.publish(event(seq))
    await asyncio.sleep(0)
    fanout.publish(event(4))
    fanout.publish(event(5))
    assert await task == [1, 2, 3, 4, 5]
    for i, seqs in enumerate(seen_in_store, start=1):
        assert i in seqs  # committed before any subscriber saw it
    await fanout.flush()
    stored = [seq for seq, _ in await store.events_since(SID, 0, max_bytes=1 << 30)]
    assert stored == [1, 2, 3, 4, 5]
    await fanout.close()
    assert sub.closed


async def test_order_kept_while_a_big_commit_runs_on_the_store_thread(store: SqliteStore) -> None:
    fanout = SessionFanout(SID, store)
    sub = fanout.subscribe(8 << 20)
    fanout.publish(event(1, "z" * 200_000))  # over the inline limit: the store thread
    for _ in range(3):
        await asyncio.sleep(0)  # that commit is now in flight on the thread
    fanout.publish(event(2))
    fanout.publish(event(3))
    assert [i.seq for i in await take(sub, 3)] == [1, 2, 3]
    await fanout.flush()
    assert await stored_seqs(store) == [1, 2, 3]
    await fanout.close()


async def test_a_failed_write_is_retried_in_order_and_reported(store: SqliteStore) -> None:
    errors: list[Exception] = []
    fanout = SessionFanout(SID, store, on_error=errors.append, retry_after=0.2)
    sub = fanout.subscribe(1 << 20)
    fanout.publish(event(1))
    await fanout.flush()
    await take(sub, 1)

    await statement(store, "ALTER TABLE events RENAME TO events_away")
    fanout.publish(event(2))
    fanout.publish(event(3))
    await asyncio.sleep(0.05)
    assert errors, "the failure was not reported"
    fanout.publish(event(4))  # published while the failed rows wait: goes after them
    assert sub.queue.empty()  # nothing uncommitted reached a subscriber
    await statement(store, "ALTER TABLE events_away RENAME TO events")

    assert [i.seq for i in await take(sub, 3)] == [2, 3, 4]
    await asyncio.wait_for(fanout.flush(), 5)
    assert await stored_seqs(store) == [1, 2, 3, 4]
    await fanout.close()


async def test_a_slow_subscriber_overflows_instead_of_growing(store: SqliteStore) -> None:
    fanout = SessionFanout(SID, store)
    slow = fanout.subscribe(1000)
    fast = fanout.subscribe(1 << 20)
    for seq in range(1, 21):
        fanout.publish(event(seq, "y" * 100))
    await fanout.flush()
    assert slow.overflowed and slow.queued_bytes == 0
    assert await slow.get() is None  # its reader catches up from the store instead
    assert [i.seq for i in await take(fast, 20)] == list(range(1, 21))
    await fanout.close()


async def test_a_transient_failure_on_the_store_thread_keeps_order(store: SqliteStore) -> None:
    """The commit of a big event fails on the store thread while a later event waits; the
    store recovers before the later one would be written. The later one must still reach
    subscribers after the retried one, never before."""
    errors: list[Exception] = []
    fanout = SessionFanout(SID, store, on_error=errors.append, retry_after=0.1)
    sub = fanout.subscribe(8 << 20)
    await statement(store, "ALTER TABLE events RENAME TO events_away")
    fanout.publish(event(1, "z" * 200_000))  # over the inline limit: the store thread
    for _ in range(3):
        await asyncio.sleep(0)  # that commit is now queued on the thread
    repaired = statement(store, "ALTER TABLE events_away RENAME TO events", on_thread=True)
    fanout.publish(event(2))
    await repaired
    assert [i.seq for i in await take(sub, 2)] == [1, 2]
    assert errors
    await fanout.close()


async def test_direct_delivery_while_nothing_is_buffered_and_order_kept_when_it_declines(
    store: SqliteStore,
) -> None:
    fanout = SessionFanout(SID, store)
    sub = fanout.subscribe(1 << 20)
    delivered: list[int] = []
    accept = True

    def direct(item: Published) -> bool:
        if accept:
            delivered.append(item.seq)
        return accept

    sub.direct = direct
    fanout.publish(event(1))
    fanout.publish(event(2))
    await fanout.flush()
    assert delivered == [1, 2] and sub.queue.empty()  # no buffer, no reader wake-up
    accept = False  # e.g. the socket stopped keeping up
    fanout.publish(event(3))
    await fanout.flush()
    accept = True
    fanout.publish(event(4))  # something is buffered: it queues behind, never overtakes
    await fanout.flush()
    assert delivered == [1, 2]
    assert [item.seq for item in await take(sub, 2)] == [3, 4]
    fanout.publish(event(5))  # drained: direct again
    await fanout.flush()
    assert delivered == [1, 2, 5]
    assert await stored_seqs(store) == [1, 2, 3, 4, 5]  # and all of it is stored


async def test_batch_end_once_a_commits_events_are_all_offered(store: SqliteStore) -> None:
    fanout = SessionFanout(SID, store)
    sub = fanout.subscribe(1 << 20)
    seen: list[object] = []
    sub.direct = lambda item: seen.append(item.seq) is None
    sub.batch_end = lambda: seen.append("end")
    fanout.publish(event(1))
    fanout.publish(event(2))  # the same loop turn: one commit, one batch
    await fanout.flush()
    fanout.publish(event(3))
    await fanout.flush()
    assert seen == [1, 2, "end", 3, "end"]
    await fanout.close()


def final(execution_id: str) -> tuple[ExecutionRecord, AuditEntry]:
    now = datetime.now(UTC)
    record = ExecutionRecord(
        execution_id=execution_id, status=ExecutionStatus.COMPLETED, ended_by=EndedBy.REPLY,
        queued_at=now, finished_at=now,
    )  # fmt: skip
    return record, AuditEntry(principal="alice", action="execution", session_id=SID)


async def test_a_lone_cells_final_commits_now_among_many_it_rides_the_turn(
    store: SqliteStore,
) -> None:
    fanout = SessionFanout(SID, store)
    sub = fanout.subscribe(1 << 20)
    delivered: list[int] = []
    sub.direct = lambda item: delivered.append(item.seq) is None
    fanout.publish(event(1))
    fanout.publish(event(2))
    store.finish_execution(*final("e1"))  # three writes: committed and delivered at once
    assert delivered == [1, 2]
    for seq in range(3, 12):
        fanout.publish(event(seq))
    store.finish_execution(*final("e2"))  # ten writes pending: they wait for the turn's end
    assert delivered == [1, 2]
    await fanout.flush()
    assert delivered == list(range(1, 12))
    assert await stored_seqs(store) == list(range(1, 12))
    await fanout.close()


async def test_a_failing_batch_end_stalls_nothing(store: SqliteStore) -> None:
    fanout = SessionFanout(SID, store)
    sub = fanout.subscribe(1 << 20)

    def broken() -> None:
        raise OSError("the socket went away")

    sub.batch_end = broken
    for seq in (1, 2):
        flushing = asyncio.ensure_future(fanout.flush())  # waits before the commit runs
        fanout.publish(event(seq))
        await asyncio.wait_for(flushing, 5)
    assert [item.seq for item in await take(sub, 2)] == [1, 2]
    assert await stored_seqs(store) == [1, 2]
    await fanout.close()


async def test_quiet_events_wait_for_company_or_their_window(store: SqliteStore) -> None:
    """A status event's commit waits (``quiet_wait``) for the writes that follow and goes
    with the first output; alone, it goes when its window ends; a flush does not wait."""
    fanout = SessionFanout(SID, store, quiet_wait=0.3)
    sub = fanout.subscribe(1 << 20)
    commits: list[list[int]] = []
    sub.direct = lambda item: commits[-1].append(item.seq) is None
    sub.batch_end = lambda: commits.append([])
    commits.append([])

    def running(seq: int) -> StatusEvent:
        return StatusEvent(execution_id="e1", seq=seq, status=ExecutionStatus.RUNNING)

    fanout.publish(running(1))
    await asyncio.sleep(0.05)
    assert commits == [[]]  # (not asking the store: a read commits what is pending)
    fanout.publish(running(2))
    fanout.publish(event(3))  # output: the commit goes at the end of this turn, all three
    await asyncio.sleep(0.01)
    assert commits == [[1, 2, 3], []]

    fanout.publish(running(4))  # alone: after its window
    await asyncio.sleep(0.1)
    assert commits == [[1, 2, 3], []]
    await asyncio.sleep(0.4)
    assert commits == [[1, 2, 3], [4], []]

    fanout.publish(running(5))
    await asyncio.wait_for(fanout.flush(), 0.1)  # someone waits: no window
    assert commits == [[1, 2, 3], [4], [5], []]
    assert await stored_seqs(store) == [1, 2, 3, 4, 5]
    await fanout.close()


async def test_each_event_names_the_one_published_before_it(store: SqliteStore) -> None:
    """``prev`` is what lets a reader (kernelhub.replay) see that it missed an event even
    though seqs have holes (silent calls take numbers): a reader that lost one catches up
    from the store, which has it."""
    fanout = SessionFanout(SID, store)
    sub = fanout.subscribe(1 << 20)
    for seq in (1, 2, 5, 9):
        fanout.publish(event(seq))
    items = await take(sub, 4)
    assert [(i.seq, i.prev) for i in items] == [(1, 0), (2, 1), (5, 2), (9, 5)]

    replay = Replay(0, live=True)
    assert [replay.live(i.seq, i.prev) for i in items[:2]] == [Verdict.DELIVER] * 2
    # Item 5 never reaches this reader; 9 says 5 came before it.
    assert replay.live(items[3].seq, items[3].prev) is Verdict.GAP
    replay.fell_behind()
    caught_up = []
    while replay.replaying:
        for seq, _ in replay.page(await store.events_since(SID, replay.last, 1)):
            caught_up.append(seq)
            replay.delivered(seq)
    assert caught_up == [5, 9]
    await fanout.close()


async def test_big_events_are_serialized_in_slices_and_keep_their_place(
    store: SqliteStore,
) -> None:
    """One 8 MiB event is written a slice at a time (other callbacks run between the
    slices); the events published around it still reach the store and subscribers in
    order, each the model's JSON."""
    fanout = SessionFanout(SID, store)
    sub = fanout.subscribe(64 << 20)
    image = "iVBORw0KGgo" * (800 << 10)  # ~8.6 MB, one string
    tricky = ('"\\\n\x00é€\U0001f600' * (40 << 10)) + "\ud83d"  # escapes, a lone surrogate
    events = [
        event(1, "before"),
        DisplayEvent(execution_id="e1", seq=2, data={"image/png": image}, metadata={"m": tricky}),
        event(3, "between"),
        ErrorEvent.model_validate(
            {
                "execution_id": "e1",
                "seq": 4,
                "error": {"name": "E", "value": "v" * (3 << 20), "traceback": [tricky]},
            }
        ),
        event(5, "after"),
    ]
    ticks = [0]
    async with _counting_loop_turns(ticks):
        for e in events:
            fanout.publish(e)
        assert not fanout.joins_this_commit()  # a big one is still being written
        got = await take(sub, len(events))
    assert [i.seq for i in got] == [1, 2, 3, 4, 5]
    assert [i.prev for i in got] == [0, 1, 2, 3, 4]
    assert ticks[0] > 2 * (len(image) // jsonslices.SLICE)  # the loop ran between slices
    for item, e in zip(got, events, strict=True):
        item.body.encode()  # UTF-8: the lone surrogate was escaped
        assert json.loads(item.body) == json.loads(json.dumps(e.model_dump(mode="json")))
    await fanout.flush()
    stored = [seq for seq, _ in await store.events_since(SID, 0, max_bytes=1 << 30)]
    assert stored == [1, 2, 3, 4, 5]
    await fanout.close()


async def test_many_value_events_are_written_a_group_at_a_time(store: SqliteStore) -> None:
    """An event of many small values (a figure's number arrays, records) goes the sliced
    way too, the kernel's JSON as it is (no pydantic copy), equal to the model's JSON."""
    fanout = SessionFanout(SID, store)
    sub = fanout.subscribe(64 << 20)
    figure = {
        "data": [{"x": list(range(100_000)), "y": [i / 7 for i in range(100_000)]}],
        "records": [{"a": i, "b": "é", "c": [i, None, float("nan")]} for i in range(20_000)],
    }
    shown = DisplayEvent(
        execution_id="e1", seq=1, data={"application/vnd.plotly.v1+json": figure}, metadata={}
    )
    assert big_event(shown)
    ticks = [0]
    async with _counting_loop_turns(ticks):
        fanout.publish(shown)
        fanout.publish(event(2, "after"))
        got = await take(sub, 2)
    assert [i.seq for i in got] == [1, 2]
    assert ticks[0] > 20  # the loop ran between the groups
    assert json.loads(got[0].body) == json.loads(shown.model_dump_json())
    assert list(json.loads(got[0].body)) == list(shown.model_dump(mode="json"))  # field order
    await fanout.close()


async def test_big_stored_events_read_back_as_the_events_published(store: SqliteStore) -> None:
    """events_of (REST reads) parses big bodies a slice at a time: the same models."""
    fanout = SessionFanout(SID, store)
    image = "iVBORw0KGgo" * (100 << 10)  # ~1.1 MB: sliced
    shown = DisplayEvent(
        execution_id="e1",
        seq=1,
        data={"image/png": image, "application/json": {"x": list(range(50_000))}},
        metadata={"m": "é" * 10},
    )
    events = [event(0, "small"), shown]
    for e in events:
        fanout.publish(e)
    await fanout.flush()
    got = await store.events_of("e1")
    assert [g.model_dump() for g in got] == [e.model_dump() for e in events]
    await fanout.close()


@contextlib.asynccontextmanager
async def _counting_loop_turns(ticks: list[int]) -> AsyncIterator[None]:
    """Counts the event loop's turns into ``ticks[0]`` while the block runs: proof that
    the loop ran between a big event's slices."""

    async def ticker() -> None:
        while True:
            ticks[0] += 1
            await asyncio.sleep(0)

    beat = asyncio.create_task(ticker())
    try:
        yield
    finally:
        beat.cancel()


async def test_room_holds_the_kernel_back_while_a_big_event_waits_to_be_serialized(
    store: SqliteStore,
) -> None:
    # The kernel's pumps ask ``room()`` after each message: a big event waiting to be
    # serialized stops them until the slicing task takes it; the one being sliced does not.
    fanout = SessionFanout(SID, store)
    big = "y" * (3 * jsonslices.SLICE)
    assert fanout.room() is None
    fanout.publish(event(1, big))
    first = fanout.room()
    assert first is not None and not first.done()  # the task has not taken it yet
    await asyncio.wait_for(first, 5)
    assert fanout.room() is None  # being sliced: nothing waits behind it
    fanout.publish(event(2, big))  # waits behind the first: the pumps must stop
    wait = fanout.room()
    assert wait is not None and not wait.done()
    assert fanout.room() is wait  # every pump waits on the same future
    await asyncio.wait_for(wait, 5)
    await fanout.flush()
    assert await stored_seqs(store) == [1, 2]
    assert fanout.room() is None


async def test_room_holds_the_kernel_back_past_the_uncommitted_byte_backlog(
    store: SqliteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernelhub.session import fanout as module

    monkeypatch.setattr(module, "BACKLOG_BYTES", 1000)
    fanout = SessionFanout(SID, store)
    fanout.publish(event(1, "a" * 600))
    assert fanout.room() is None  # ~700 bytes of body: under the backlog
    fanout.publish(event(2, "b" * 600))
    wait = fanout.room()
    assert wait is not None and not wait.done()  # past it until the store commits
    await asyncio.wait_for(wait, 5)
    assert fanout.room() is None
    assert await stored_seqs(store) == [1, 2]
    # A closed fan-out never holds anyone back, even with a backlog.
    fanout.publish(event(3, "c" * 2000))
    await fanout.close()
    assert fanout.room() is None
