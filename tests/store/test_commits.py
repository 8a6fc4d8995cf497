"""The store's shared commits against each backend: a write that may wait rides with what
follows, and its callback runs only once the row is committed (another connection, as
after a crash, sees it)."""

from __future__ import annotations

import asyncio

from kernelhub.models import ExecutionStatus, StatusEvent, StreamEvent
from kernelhub.session.fanout import SessionFanout
from kernelhub.store.sql import SqlStore
from tests.store.rows import committed, execution, session

SID = "s1"


def on_disk(store: SqlStore, execution_id: str) -> bool:
    return bool(committed(store, "SELECT 1 FROM executions WHERE id = ?", execution_id))


async def test_a_new_execution_waits_with_its_running_and_is_on_disk_before_anyone_hears(
    store: SqlStore,
) -> None:
    await store.insert_session(session(SID))
    fanout = SessionFanout(SID, store, quiet_wait=0.3)
    sub = fanout.subscribe(1 << 20)
    seen: list[object] = []
    sub.direct = lambda item: seen.append(item.seq) is None

    fanout.publish(StatusEvent(execution_id="e1", seq=1, status=ExecutionStatus.RUNNING))
    store.insert_execution(
        execution("e1", SID), lambda error: seen.append(on_disk(store, "e1")), wait=0.3
    )
    await asyncio.sleep(0.05)
    assert seen == [] and not on_disk(store, "e1")  # both wait for company

    fanout.publish(StreamEvent(execution_id="e1", seq=2, name="stdout", text="1\n"))
    for _ in range(100):  # output does not wait, and takes them along (one commit)
        if len(seen) == 3:
            break
        await asyncio.sleep(0.01)
    assert seen == [1, True, 2]
    await fanout.close()
