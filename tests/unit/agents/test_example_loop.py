"""The example agent loop and its scripted model (kernelhub/agents/example_loop.py), with
the real ToolRunner over a stand-in session that runs the cell in this interpreter:
the answer's number comes from executing the code the model wrote."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import pytest

from kernelhub.agents.example_loop import ScriptedModel, agent_loop, main
from kernelhub.agents.tools import ToolRunner, anthropic_tools
from kernelhub.models import Event, Execution
from tests.unit.agents._cells import run_here


class ExecSession:
    """Runs each cell with exec() here and returns its stdout (or its exception)."""

    def __init__(self, rewrite: Callable[[str], str] = lambda code: code) -> None:
        self.rewrite = rewrite
        self.codes: list[str] = []

    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: Callable[[Event], object] | None = None,
    ) -> Execution:
        self.codes.append(code)
        return run_here(self.rewrite(code))


def runner(session: ExecSession) -> ToolRunner:
    return ToolRunner(session)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 100, 12345])
async def test_the_loop_answers_with_the_number_the_cell_printed(n: int) -> None:
    session = ExecSession()
    answer = await agent_loop(ScriptedModel(), runner(session), f"the sum of 1..{n} please")
    assert answer == f"The sum is {n * (n + 1) // 2}, verified with Python."
    assert len(session.codes) == 1


async def test_a_wrong_cell_changes_the_answer() -> None:
    # the "kernel" adds one: the model must report what Python said, not what it expected
    session = ExecSession(lambda code: code.replace("print(sum(", "print(1 + sum("))
    answer = await agent_loop(ScriptedModel(), runner(session), "sum of 1..10")
    assert answer == "The sum is 56, verified with Python."


async def test_a_failing_cell_is_not_read_as_a_number() -> None:
    session = ExecSession(lambda code: "raise ValueError('no kernel today')")
    answer = await agent_loop(ScriptedModel(), runner(session), "sum of 1..10")
    assert answer.startswith("The tool did not give me a number") and "no kernel today" in answer


async def test_requests_it_cannot_handle_and_missing_tools() -> None:
    model = ScriptedModel()
    user = [{"role": "user", "content": "write me a poem"}]
    reply = await model.respond(user, anthropic_tools())
    assert reply["content"] == [{"type": "text", "text": "I can only sum ranges like 1..100."}]
    no_tools = await model.respond([{"role": "user", "content": "sum of 1..5"}], [])
    assert "execute_python" in no_tools["content"][0]["text"]


async def test_the_model_asks_for_the_tool_with_code_that_sums_the_range() -> None:
    reply = await ScriptedModel().respond(
        [{"role": "user", "content": "sum of 1 .. 7"}], anthropic_tools()
    )
    (call,) = [b for b in reply["content"] if b["type"] == "tool_use"]
    assert call["name"] == "execute_python"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(call["input"]["code"], {})
    assert buffer.getvalue() == f"{sum(range(1, 8))}\n"


class Insistent:
    """A model that never stops calling tools."""

    async def respond(self, messages: list[Any], tools: list[Any]) -> dict[str, Any]:
        code = {"code": "print(1)"}
        call = {"type": "tool_use", "id": "t", "name": "execute_python", "input": code}
        return {"role": "assistant", "content": [call]}


@pytest.mark.parametrize("turns", [1, 3])
async def test_a_model_that_never_answers_stops_after_max_turns(turns: int) -> None:
    session = ExecSession()
    with pytest.raises(RuntimeError, match=f"within {turns} turns"):
        await agent_loop(Insistent(), runner(session), "hi", max_turns=turns)
    assert len(session.codes) == turns


def test_main_without_a_token_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNELHUB_TOKEN", raising=False)
    with pytest.raises(SystemExit) as raised:
        main()
    assert "KERNELHUB_TOKEN" in str(raised.value.code)
