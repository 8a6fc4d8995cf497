"""The MCP server's kernels (kernelhub/agents/mcp_kernels.py): which handles expire,
what a tool call does with its cell's events (live output, input it cannot ask for,
interrupt on cancel), and the handle table per principal. The sessions are a small
stand-in recording what it is asked (the real ones: tests/gateway/test_mcp*.py)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import anyio
import pytest

from kernelhub.agents.mcp_kernels import (
    CALL,
    AwaitingInput,
    CallHooks,
    Kernel,
    Kernels,
    LiveSession,
    died,
    idle_handles,
    settle,
)
from kernelhub.agents.mcp_live import LiveOutput
from kernelhub.agents.tools import ToolRunner
from kernelhub.client import AsyncHub
from kernelhub.client.errors import ApiError, NotFoundError, SessionEndedError
from kernelhub.models import (
    EndedBy,
    Event,
    Execution,
    ExecutionRecord,
    ExecutionStatus,
    InputRequestEvent,
    StreamEvent,
)
from kernelhub.wire import RecoveryInfo, SessionInfo, SessionState

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def execution(eid: str, status: ExecutionStatus = ExecutionStatus.COMPLETED) -> Execution:
    record = ExecutionRecord(
        execution_id=eid, status=status, ended_by=EndedBy.REPLY, queued_at=NOW, finished_at=NOW
    )
    return Execution(record=record, events=[])


def out(eid: str, text: str, seq: int = 1) -> StreamEvent:
    return StreamEvent(execution_id=eid, seq=seq, name="stdout", text=text)


class Session:
    """Stands in for an AsyncSession: replays ``events`` to on_event, records calls."""

    def __init__(self, sid: str, events: list[Event] | None = None, gone: Exception | None = None):
        self.id = sid
        self.events = events or []
        self.gone = gone  # what delete() raises (the session already ended)
        self.block = False  # run() waits forever after its events (to be cancelled)
        self.calls: list[tuple[str, Any]] = []

    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: Callable[[Event], object] | None = None,
        on_input: Any = None,
    ) -> Execution:
        self.calls.append(("run", code, on_input))
        for event in self.events:
            if on_event is not None:
                on_event(event)
        if self.block:
            await anyio.sleep_forever()
        return execution(self.events[0].execution_id if self.events else "e0")

    async def interrupt(self, execution_id: str) -> None:
        self.calls.append(("interrupt", execution_id))
        if execution_id == "refused":
            raise ApiError(409, "conflict", "not running")

    async def delete(self) -> None:
        self.calls.append(("delete",))
        if self.gone is not None:
            raise self.gone


def kernel(sid: str, principal: str = "", used: float = 0.0, **session: Any) -> Kernel:
    s = Session(sid, **session)
    return Kernel(s, ToolRunner(LiveSession(s)), principal, used)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("now", "timeout", "expected"),
    [
        (100.0, 50.0, ["a", "b"]),  # both idle ≥ 50 s (b exactly 50: expires)
        (100.0, 60.0, ["a"]),
        (100.0, 1000.0, []),
        (100.0, None, []),  # None: never expire
        (100.0, 0.0, ["a", "b", "c"]),
    ],
)
def test_idle_handles(now: float, timeout: float | None, expected: list[str]) -> None:
    assert idle_handles({"c": 100.0, "b": 50.0, "a": 10.0}, now, timeout) == expected


def test_hooks_record_each_execution_once_and_gather_its_output() -> None:
    hooks = CallHooks(LiveOutput(), on_input=lambda _: None)  # type: ignore[arg-type,return-value]
    for event in (out("e1", "a\n"), out("e1", "b\n", 2), out("e2", "c\n", 3)):
        hooks.seen(event)
    assert hooks.executions == ["e1", "e2"]
    assert "".join(hooks.live.seen) == "a\nb\nc\n"


def test_input_without_elicitation_returns_early_with_the_output_so_far() -> None:
    hooks = CallHooks(LiveOutput())
    hooks.seen(out("e1", "working\n"))
    with pytest.raises(AwaitingInput) as raised:
        hooks.seen(InputRequestEvent(execution_id="e1", seq=7, prompt="name? "))
    got = raised.value
    assert (got.execution_id, got.prompt, got.seq, got.output) == ("e1", "name? ", 7, "working\n")


def test_input_with_elicitation_is_not_an_early_return() -> None:
    async def ask(prompt: str) -> str:
        return "x"

    hooks = CallHooks(LiveOutput(), on_input=ask)
    hooks.seen(InputRequestEvent(execution_id="e1", seq=1, prompt="p"))
    assert hooks.executions == ["e1"]


@pytest.mark.parametrize(
    ("status", "expected"),
    [(ExecutionStatus.KERNEL_DIED, True), (ExecutionStatus.FAILED, False), (None, False)],
)
def test_died(status: ExecutionStatus | None, expected: bool) -> None:
    hooks = CallHooks(LiveOutput())
    hooks.finished = None if status is None else execution("e1", status)
    assert died(hooks) is expected


async def test_live_session_outside_a_call_is_the_plain_session() -> None:
    session = Session("s1", [out("e1", "hi\n")])
    seen: list[Event] = []
    result = await LiveSession(session).run("x", on_event=seen.append)  # type: ignore[arg-type]
    assert result.id == "e1" and len(seen) == 1
    assert session.calls == [("run", "x", None)]  # no on_input passed outside a call


async def test_live_session_inside_a_call_feeds_the_hooks_and_the_caller() -> None:
    session = Session("s1", [out("e1", "hi\n")])
    hooks = CallHooks(LiveOutput())
    seen: list[Event] = []
    token = CALL.set(hooks)
    try:
        result = await LiveSession(session).run("x", on_event=seen.append)  # type: ignore[arg-type]
    finally:
        CALL.reset(token)
    assert hooks.finished is result and hooks.executions == ["e1"]
    assert [e.seq for e in seen] == [1] and hooks.live.seen == ["hi\n"]


async def test_a_cancelled_call_interrupts_its_cells() -> None:
    session = Session("s1", [out("e1", "a\n"), out("refused", "b\n", 2), out("e3", "c\n", 3)])
    session.block = True
    hooks = CallHooks(LiveOutput())

    async def call() -> None:
        CALL.set(hooks)
        await LiveSession(session).run("x")  # type: ignore[arg-type]

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        with anyio.fail_after(5):
            while len(hooks.executions) < 3:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    # every cell of the call, even after one refuses (it had already finished)
    assert [c[1] for c in session.calls if c[0] == "interrupt"] == ["e1", "refused", "e3"]
    assert hooks.finished is None


async def test_handles_are_per_principal_and_touching_one_keeps_it() -> None:
    now = [0.0]
    kernels = Kernels(None, runner_options={}, idle_timeout=10.0, clock=lambda: now[0])  # type: ignore[arg-type]
    mine, theirs = kernel("s1", "alice"), kernel("s2", "bob")
    kernels.keep(mine)
    kernels.keep(theirs)
    assert kernels.get("bob", "s1") is None  # another principal's handle is no handle
    assert [k.handle for k in kernels.of("alice")] == ["s1"]
    now[0] = 8.0
    assert kernels.get("alice", "s1") is mine and mine.last_used == 8.0
    now[0] = 12.0
    assert await kernels.expire() == ["s2"]  # s1 was touched at 8
    assert ("bob", "s2") in kernels.expired and theirs.session.calls == [("delete",)]  # type: ignore[attr-defined]
    mine.busy = 1
    now[0] = 100.0
    assert await kernels.expire() == []  # a kernel mid-call never expires
    mine.busy = 0
    assert await kernels.expire() == ["s1"]
    assert kernels.handles == {}


async def test_never_expiring_handles_and_forgetting_a_session_already_gone() -> None:
    kernels = Kernels(None, runner_options={}, idle_timeout=None, clock=lambda: 1e9)  # type: ignore[arg-type]
    a = kernel("s1", gone=NotFoundError(404, "not_found", "no such session"))
    b = kernel("s2", gone=SessionEndedError(409, "session_ended", "ended"))
    kernels.keep(a)
    kernels.keep(b)
    assert await kernels.expire() == []
    await kernels.reap()  # returns at once when nothing ever expires
    await kernels.forget(a)  # already deleted on the gateway: not an error
    assert list(kernels.handles) == [("", "s2")]
    await kernels.close()
    assert kernels.handles == {} and b.session.calls == [("delete",)]  # type: ignore[attr-defined]


async def test_other_delete_failures_are_not_swallowed() -> None:
    kernels = Kernels(None, runner_options={})  # type: ignore[arg-type]
    k = kernel("s1", gone=ApiError(500, "internal", "boom"))
    kernels.keep(k)
    with pytest.raises(ApiError):
        await kernels.forget(k)


async def test_a_callers_token_gets_its_own_hub_the_server_keeps_its_own() -> None:
    server = AsyncHub("http://127.0.0.1:1", "server-token")
    kernels = Kernels(server, runner_options={})
    try:
        assert kernels._hub("") is server
        alice = kernels._hub("alice-token")
        assert alice is not server and alice is kernels._hub("alice-token")
        assert alice.base_url == server.base_url and kernels._hub("bob") is not alice
    finally:
        await kernels.close()
        await server.close()
    assert kernels.hubs == {}


def info(state: SessionState, recovery: RecoveryInfo | None = None) -> SessionInfo:
    return SessionInfo(
        id="s1", owner="o", state=state, backend="local", created_at=NOW, limits={},
        metadata={}, recovery=recovery,
    )  # fmt: skip


class Dying:
    """A session whose kernel died: info() walks through ``states`` (then stays)."""

    def __init__(self, *states: SessionState | Exception, recovery: RecoveryInfo | None = None):
        self.states = list(states)
        self.recovery = recovery
        self.last_info = info(SessionState.BUSY)
        self.asked = 0

    async def info(self) -> SessionInfo:
        self.asked += 1
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if isinstance(state, Exception):
            raise state
        return info(state, self.recovery)


async def test_a_recovered_kernel_is_reported_with_what_came_back() -> None:
    recovery = RecoveryInfo(
        at=NOW,
        reason="out of memory",
        checkpoint_after_cell=3,
        lost=["e4"],
        duration=1.0,
        message="restored cell 3",
    )
    session = Dying(SessionState.STARTING, SessionState.READY, recovery=recovery)
    said = await settle(Kernel(session, None, ""))  # type: ignore[arg-type]
    assert said.startswith("[kernel] the kernel died and kernelhub recovered the session")
    assert "(restored cell 3)" in said and session.asked == 2


@pytest.mark.parametrize(
    "end",
    [SessionState.DEAD, NotFoundError(404, "not_found", "gone")],
    ids=["dead", "deleted"],
)
async def test_a_kernel_given_up_says_the_next_call_starts_fresh(
    end: SessionState | Exception,
) -> None:
    session = Dying(SessionState.BUSY, end)
    said = await settle(Kernel(session, None, ""))  # type: ignore[arg-type]
    assert "fresh session" in said and "recovered" not in said
    assert session.asked == 2


async def test_a_kernel_still_recovering_is_waited_for() -> None:
    recovery = RecoveryInfo(
        at=NOW, reason="killed", checkpoint_after_cell=1, lost=[], duration=0.5,
        message="restored cell 1",
    )  # fmt: skip
    session = Dying(SessionState.RECOVERING, SessionState.READY, recovery=recovery)
    said = await settle(Kernel(session, None, ""))  # type: ignore[arg-type]
    assert "recovered the session (restored cell 1)" in said
