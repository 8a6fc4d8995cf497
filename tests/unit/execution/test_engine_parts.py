"""The engine's collaborators without a kernel: routing, the queue, the pause-aware clock,
and the final record, driven with Jupyter messages as data."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from kernelhub.config import Limits
from kernelhub.errors import KernelError
from kernelhub.execution.collector import OVERSIZED_KEY, OutputCollector
from kernelhub.execution.handle import ExecutionHandle
from kernelhub.execution.record import finished_record, reply_outcome, unstarted_record
from kernelhub.execution.router import MessageRouter
from kernelhub.execution.timeouts import PauseGate, wait_running
from kernelhub.execution.worker import CellWorker, Exclusive
from kernelhub.models import (
    EndedBy,
    Event,
    Execution,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    InputRequestEvent,
    NoticeEvent,
    ResourceUsage,
    StatusEvent,
    StreamEvent,
)
from tests.conftest import UNIT, eventually


def msg(msg_type: str, parent: str, **content: Any) -> dict[str, Any]:
    return {
        "header": {"msg_type": msg_type, "msg_id": f"{msg_type}-{parent}"},
        "parent_header": {"msg_id": parent},
        "metadata": {},
        "content": content,
    }


def reply(parent: str, status: str = "ok") -> list[dict[str, Any]]:
    return [
        msg("execute_reply", parent, status=status, execution_count=1),
        msg("status", parent, execution_state="idle"),
    ]


class Routed:
    def __init__(self, limits: Limits | None = None) -> None:
        self.events: list[tuple[ExecutionHandle | None, Event]] = []
        self.asked: list[InputRequestEvent] = []
        seq = itertools.count(1)
        self.router = MessageRouter(
            "s1",
            limits or Limits(),
            emit=lambda h, e: self.events.append((h, e)),
            next_seq=lambda: next(seq),
            on_input=lambda h, e: self.asked.append(e),
        )

    def texts(self, handle: ExecutionHandle | None) -> str:
        return "".join(e.text for h, e in self.events if h is handle and isinstance(e, StreamEvent))


async def test_messages_go_to_the_cell_they_name_and_its_end_settles_it() -> None:
    r = Routed()
    handle = ExecutionHandle("e1", "print(1)", None)
    active = r.router.begin(handle, "m1")
    r.router.route(msg("status", "m1", execution_state="busy"))
    r.router.route(msg("stream", "m1", name="stdout", text="1\n"))
    assert r.texts(handle) == "1\n" and not active.done.done()
    assert not any(isinstance(e, StatusEvent) for _, e in r.events)  # the engine's job
    for m in reply("m1"):
        r.router.route(m)
    assert active.done.done()


async def test_late_output_of_a_finished_cell_and_output_of_no_cell() -> None:
    r = Routed()
    first = ExecutionHandle("e1", "", None)
    r.router.begin(first, "m1")
    r.router.active = None
    second = ExecutionHandle("e2", "", None)
    r.router.begin(second, "m2")
    r.router.route(msg("stream", "m1", name="stdout", text="late\n"))
    r.router.route(msg("stream", "unknown", name="stdout", text="orphan\n"))
    r.router.route(msg("display_data", "unknown", data={}, metadata={}))  # not a stream: dropped
    assert r.texts(first) == "late\n" and r.texts(second) == ""
    assert r.texts(None) == "orphan\n"


async def test_only_the_recent_cells_are_remembered() -> None:
    r = Routed()
    handles = [ExecutionHandle(f"e{i}", "", None) for i in range(70)]
    for i, h in enumerate(handles):
        r.router.begin(h, f"m{i}")
    r.router.route(msg("stream", "m0", name="stdout", text="forgotten\n"))
    r.router.route(msg("stream", "m69", name="stdout", text="kept\n"))
    assert r.texts(handles[0]) == "" and r.texts(None) == "forgotten\n"
    assert r.texts(handles[69]) == "kept\n"


async def test_an_oversized_message_is_charged_to_the_running_cell() -> None:
    r = Routed(Limits(output_bytes=4096))
    handle = ExecutionHandle("e1", "", None)
    r.router.begin(handle, "m1")
    r.router.route({OVERSIZED_KEY: 50_000_000, "parent_header": {"msg_id": "forged"}})
    assert any(h is handle for h, _ in r.events)
    r.router.active = None
    before = len(r.events)
    r.router.route({OVERSIZED_KEY: 50_000_000, "parent_header": {}})  # no cell to pay
    assert len(r.events) == before


async def test_input_requests_are_announced() -> None:
    r = Routed()
    handle = ExecutionHandle("e1", "", None)
    r.router.begin(handle, "m1")
    r.router.route(msg("input_request", "m1", prompt="name? ", password=True))
    assert [e.prompt for e in r.asked] == ["name? "] and r.asked[0].password


async def test_an_interrupt_that_ends_with_idle_but_no_reply_settles_after_a_grace() -> None:
    r = Routed()
    handle = ExecutionHandle("e1", "", None)
    active = r.router.begin(handle, "m1")
    handle.interrupt_sent = True
    r.router.route(msg("status", "m1", execution_state="idle"))
    assert active.collector.settling and not active.done.done()
    r.router.route(msg("stream", "m1", name="stdout", text="x"))  # still settling
    await asyncio.wait_for(active.done, 5 * UNIT)


async def test_a_reset_connection_is_told_to_the_running_cell() -> None:
    r = Routed()
    r.router.connection_reset("iopub")  # no running cell: nothing to tell
    assert r.events == []
    handle = ExecutionHandle("e1", "", None)
    active = r.router.begin(handle, "m1")
    r.router.route(msg("execute_reply", "m1", status="ok", execution_count=1))
    r.router.connection_reset("iopub")
    assert any(isinstance(e, NoticeEvent) for _, e in r.events)
    await asyncio.wait_for(active.done, 5 * UNIT)


async def test_the_worker_runs_begun_cells_then_the_queue_in_order() -> None:
    ran: list[tuple[str, object]] = []

    async def run_cell(handle: ExecutionHandle, begun: str | None) -> None:
        ran.append((handle.id, begun))

    worker: CellWorker[str] = CellWorker(run_cell)
    task = asyncio.create_task(worker.run())
    try:
        assert worker.idle()
        worker.begun(ExecutionHandle("a", "", None), "started")
        assert not worker.idle()
        worker.enqueue(ExecutionHandle("b", "", None))
        loop = asyncio.get_running_loop()
        ok: asyncio.Future[Any] = loop.create_future()
        failed: asyncio.Future[Any] = loop.create_future()

        async def answer() -> str:
            return "done"

        async def fail() -> str:
            raise KernelError("no")

        worker.enqueue(Exclusive(answer, ok))
        worker.enqueue(Exclusive(fail, failed))
        assert await ok == "done"
        with pytest.raises(KernelError):
            await failed
        assert ran == [("a", "started"), ("b", None)]
        await eventually(worker.idle, 5)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_the_cell_clock_stops_while_paused() -> None:
    gate = PauseGate()
    loop = asyncio.get_running_loop()
    handle = ExecutionHandle("e1", "", 0.2 * UNIT)
    with pytest.raises(TimeoutError):
        await wait_running(loop.create_future(), handle, gate)
    done: asyncio.Future[None] = loop.create_future()
    waiting = asyncio.create_task(wait_running(done, ExecutionHandle("e2", "", None), gate))
    gate.pause()
    await asyncio.sleep(0)
    assert gate.paused and not waiting.done()
    assert gate.resume() >= 0 and not gate.paused
    done.set_result(None)
    await asyncio.wait_for(waiting, 5 * UNIT)
    # Paused past its timeout, the cell is not timed out: only running time counts.
    frozen = ExecutionHandle("e3", "", 0.05 * UNIT)
    finished: asyncio.Future[None] = loop.create_future()
    gate.pause()
    waiting = asyncio.create_task(wait_running(finished, frozen, gate))
    await asyncio.sleep(0.1 * UNIT)
    assert not waiting.done()
    finished.set_result(None)
    await asyncio.wait_for(waiting, 5 * UNIT)


def collector_after(*messages: dict[str, Any]) -> OutputCollector:
    seq = itertools.count(1)
    c = OutputCollector("e1", "m1", limit_bytes=1000, limit_events=100, next_seq=lambda: next(seq))
    for m in messages:
        c.feed(m)
    return c


@pytest.mark.parametrize(
    ("messages", "interrupted", "outcome"),
    [
        (reply("m1"), False, (ExecutionStatus.COMPLETED, EndedBy.REPLY)),
        (reply("m1", "error"), False, (ExecutionStatus.FAILED, EndedBy.REPLY)),
        (reply("m1"), True, (ExecutionStatus.COMPLETED, EndedBy.REPLY)),  # finished first
        ([msg("status", "m1", execution_state="idle")], True,
         (ExecutionStatus.INTERRUPTED, EndedBy.INTERRUPT)),
        ([msg("error", "m1", ename="KeyboardInterrupt", evalue="", traceback=[]),
          *reply("m1", "error")], True, (ExecutionStatus.INTERRUPTED, EndedBy.INTERRUPT)),
        ([msg("error", "m1", ename="KeyboardInterrupt", evalue="", traceback=[]),
          *reply("m1", "error")], False, (ExecutionStatus.FAILED, EndedBy.REPLY)),
    ],
)  # fmt: skip
def test_how_a_cell_that_ended_on_its_own_ended(
    messages: list[dict[str, Any]], interrupted: bool, outcome: tuple[ExecutionStatus, EndedBy]
) -> None:
    assert reply_outcome(collector_after(*messages), interrupt_requested=interrupted) == outcome


def test_the_final_records() -> None:
    handle = ExecutionHandle("e1", "", None)
    handle.paused_seconds = 1.5
    c = collector_after(msg("stream", "m1", name="stdout", text="hi\n"), *reply("m1"))
    record = finished_record(
        handle, c, status=ExecutionStatus.COMPLETED, ended_by=EndedBy.REPLY, state_lost=False,
        reason=None, duration=2.0,
        before=ResourceUsage(cpu_seconds=1.0), after=ResourceUsage(cpu_seconds=1.25,
                                                                   peak_memory_bytes=7),
    )  # fmt: skip
    assert record.cpu_seconds == 0.25 and record.peak_memory_bytes == 7
    assert record.execution_count == 1 and record.output_bytes == c.output_bytes > 0
    assert record.paused_seconds == 1.5 and record.duration == 2.0
    unknown = finished_record(
        handle, c, status=ExecutionStatus.FAILED, ended_by=EndedBy.KILL, state_lost=True,
        reason="x", duration=0.0, before=ResourceUsage(), after=ResourceUsage(cpu_seconds=1.0),
    )  # fmt: skip
    assert unknown.cpu_seconds is None and unknown.state_lost
    never = unstarted_record(handle, ExecutionStatus.CANCELLED, EndedBy.CANCEL, "cancelled")
    assert never.started_at is None and never.reason == "cancelled"


async def test_a_handle_streams_its_events_and_answers_internal_calls() -> None:
    handle = ExecutionHandle("e1", "", None, keep_events=False)
    seen: list[Event] = []

    async def consume() -> None:
        async for event in handle:
            seen.append(event)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)
    handle._emit(StatusEvent(execution_id="e1", seq=1, status=ExecutionStatus.RUNNING))
    record = ExecutionRecord(
        execution_id="e1",
        status=ExecutionStatus.FAILED,
        ended_by=EndedBy.REPLY,
        reason="boom",
        queued_at=handle.queued_at,
        finished_at=handle.queued_at,
    )
    handle._emit(FinalEvent(execution_id="e1", seq=2, record=record))
    await asyncio.wait_for(task, 5 * UNIT)
    assert [e.seq for e in seen] == [2]  # without keep_events only the final one is kept
    assert handle.status == ExecutionStatus.FAILED
    result = await handle.wait()
    with pytest.raises(KernelError, match="ended failed: boom"):
        handle.answers(result)
    handle.user_expressions = {"x": 1}
    done = record.model_copy(update={"status": ExecutionStatus.COMPLETED})
    assert handle.answers(Execution(record=done, events=[])) == {"x": 1}
