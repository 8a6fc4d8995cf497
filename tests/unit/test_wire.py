"""Wire models whose logic is not covered by the round trips elsewhere."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from kernelhub.models import EndedBy, ExecutionRecord, ExecutionStatus, StreamEvent
from kernelhub.wire import BatchItemInfo, ExecutionInfo

NOW = datetime(2025, 1, 1, tzinfo=UTC)
RECORD = ExecutionRecord(
    execution_id="e1",
    status=ExecutionStatus.COMPLETED,
    ended_by=EndedBy.REPLY,
    queued_at=NOW,
    finished_at=NOW,
)
EVENTS = [StreamEvent(execution_id="e1", seq=1, name="stdout", text="hi\n")]


def info(**fields: object) -> ExecutionInfo:
    base: dict[str, object] = {
        "id": "e1",
        "session_id": "s1",
        "status": ExecutionStatus.COMPLETED,
        "code": "print('hi')",
        "created_at": NOW,
    }
    return ExecutionInfo.model_validate(base | fields)


@pytest.mark.parametrize(
    "result",
    [None, info(), info(record=RECORD), info(events=EVENTS)],
    ids=["no result", "neither", "no events", "no record"],
)
def test_a_batch_item_without_a_whole_result_has_no_execution(result: ExecutionInfo | None) -> None:
    item = BatchItemInfo(index=0, status=ExecutionStatus.COMPLETED, queued_at=NOW, result=result)
    assert item.execution is None


def test_a_batch_item_with_its_result_is_an_execution() -> None:
    item = BatchItemInfo(
        index=0,
        status=ExecutionStatus.COMPLETED,
        queued_at=NOW,
        result=info(record=RECORD, events=EVENTS),
    )
    assert item.execution is not None
    assert item.execution.stdout == "hi\n" and item.execution.record == RECORD
