"""Automatic checkpoints are armed after a cell and taken once the session has been idle:
a burst of cells gets one checkpoint, after its last cell; a busy kernel, a cancel (a
rewind, a restart) or a replaced kernel gets none (a stand-in kernel records the calls;
the real one is exercised end to end in tests/gateway/test_durable.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import Any, cast

from kernelhub.config import Limits, Settings
from kernelhub.execution.engine import ExecutionHandle, KernelSession
from kernelhub.models import EndedBy, ExecutionRecord, ExecutionStatus
from kernelhub.session.checkpoints import Checkpoints, checkpoint_delay
from kernelhub.session.continuity import rewound
from kernelhub.session.live import LiveSession
from kernelhub.store.records import StoredSession
from tests.conftest import UNIT, eventually

GRACE = 0.05 * UNIT


class StandInKernel:
    """What the checkpoints use of a kernel: its business, its turn, its calls."""

    def __init__(self) -> None:
        self.alive = True
        self.paused = False
        self.running: Any = None
        self.queue_length = 0
        self.calls: list[str] = []
        self.kernel_info: dict[str, Any] = {}  # an image without kernelhub_calls: code

    async def exclusive(self, operation: Callable[[], Awaitable[Any]]) -> Any:
        return await operation()

    async def call(
        self,
        code: str,
        expressions: dict[str, str],
        *,
        timeout: float | None,
        background: bool = False,
    ) -> Any:
        self.calls.append(code)
        return {"result": {"status": "ok", "data": {"application/json": {}}}}

    def captures(self) -> list[str]:
        return [c for c in self.calls if ".capture(" in c]


class Harness:
    def __init__(self, policy: str | float = "every_cell") -> None:
        settings = Settings()
        settings.gateway.checkpoint_grace = GRACE
        self.tasks: list[asyncio.Task[Any]] = []
        self.checkpoints = Checkpoints(settings, self.spawn)
        stored = StoredSession(
            id="s1", owner="alice", backend="local", state="ready",
            created_at=datetime.now(UTC), limits={}, metadata={}, reason=None, deleted_at=None,
        )  # fmt: skip
        self.live = LiveSession(stored=stored, limits=Limits(), fanout=cast(Any, None))
        self.live.checkpoint_policy = policy
        self.kernel = StandInKernel()
        self.live.kernel = cast(KernelSession, self.kernel)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.tasks.append(asyncio.ensure_future(coro))

    def cell(self, count: int, status: ExecutionStatus = ExecutionStatus.COMPLETED) -> None:
        handle = ExecutionHandle(f"e{count}", "x = 1", None)
        now = datetime.now(UTC)
        handle.record = ExecutionRecord(
            execution_id=handle.id, status=status, ended_by=EndedBy.REPLY, queued_at=now,
            finished_at=now, execution_count=count,
        )  # fmt: skip
        self.live.since_checkpoint.append(handle.id)
        self.checkpoints.cell_ended(self.live, cast(KernelSession, self.kernel), handle)

    async def settle(self) -> None:
        await asyncio.sleep(3 * GRACE)  # past the grace: whatever is due has been spawned
        await asyncio.gather(*self.tasks)


def test_the_delay_is_the_grace_and_a_numeric_policy_spaces_checkpoints() -> None:
    assert checkpoint_delay("every_cell", 0.1, now=100.0, last_checkpoint_at=99.99) == 0.1
    assert checkpoint_delay("off", 0.1, now=100.0, last_checkpoint_at=0.0) is None
    assert checkpoint_delay(5.0, 0.1, now=100.0, last_checkpoint_at=98.0) == 3.0
    assert checkpoint_delay(5.0, 0.1, now=100.0, last_checkpoint_at=10.0) == 0.1


async def test_a_burst_of_cells_gets_one_checkpoint_after_its_last_cell() -> None:
    h = Harness()
    for count in range(1, 6):
        h.cell(count)
        await asyncio.sleep(0)  # back to back: well inside the grace
    assert h.kernel.captures() == []  # nothing on the cells' path
    await eventually(lambda: bool(h.live.checkpoints), 5)
    await asyncio.gather(*h.tasks)
    assert len(h.kernel.captures()) == 1
    assert [n for n, _ in h.live.checkpoints] == [5]
    assert h.live.since_checkpoint == []  # what a crash now would lose: nothing
    h.cell(6)
    await h.settle()
    assert [n for n, _ in h.live.checkpoints] == [5, 6]  # incremental on the last one
    assert "ckpt-5-" in h.kernel.captures()[-1].split("base=")[1]


async def test_a_busy_kernel_a_paused_one_or_a_cancel_waits_or_drops_and_off_arms_none() -> None:
    h = Harness()
    h.cell(1)
    h.kernel.running = ExecutionHandle("user", "sleep", None)  # a user cell: it re-arms
    await h.settle()
    assert h.kernel.captures() == [] and h.live.checkpoint_due is None
    h.kernel.running = None
    h.kernel.paused = True  # frozen: it waits for the resume
    h.cell(2)
    await asyncio.sleep(3 * GRACE)
    assert h.kernel.captures() == [] and h.live.checkpoint_due is not None
    h.kernel.paused = False
    await eventually(lambda: bool(h.kernel.captures()), 5)
    await asyncio.gather(*h.tasks)
    assert [n for n, _ in h.live.checkpoints] == [2]
    h.cell(3)
    h.checkpoints.cancel(h.live)  # a rewind or restart meanwhile
    await h.settle()
    assert len(h.kernel.captures()) == 1  # only the one after cell 2
    off = Harness(policy="off")
    off.cell(1)
    assert off.live.checkpoint_due is None


async def test_a_failed_cell_is_checkpointed_and_a_replaced_kernel_is_not() -> None:
    h = Harness()
    h.cell(1, ExecutionStatus.FAILED)  # it may have bound half its names
    await h.settle()
    assert [n for n, _ in h.live.checkpoints] == [1]
    h.cell(2)
    h.live.kernel = cast(KernelSession, StandInKernel())  # recovered meanwhile
    await h.settle()
    assert len(h.kernel.captures()) == 1
    h.cell(3, ExecutionStatus.CANCELLED)
    assert h.live.checkpoint_due is None


def test_a_rewind_into_a_burst_says_which_cells_it_undoes_too() -> None:
    assert "before cell 4;" in rewound(4, 3)
    assert rewound(4, None).startswith("rewound to the state before cell 4")
    text = rewound(5, 2)
    assert "after cell 2" in text and "cells 3-4 ran back to back" in text
    assert "cell 3 ran back to back" in rewound(4, 2)
