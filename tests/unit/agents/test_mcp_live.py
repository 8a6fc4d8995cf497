"""The MCP server's pure parts with data: live output coalescing, the elicitation form a
cell's question becomes and the answer it gets back, idle session handles."""

from __future__ import annotations

import pytest

from kernelhub.agents.mcp_kernels import idle_handles
from kernelhub.agents.mcp_live import LiveOutput, answer_of, elicitation_for
from kernelhub.models import (
    CellError,
    ErrorEvent,
    ExecutionStatus,
    ResultEvent,
    StatusEvent,
    StreamEvent,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def out(text: str) -> StreamEvent:
    return StreamEvent(execution_id="e1", name="stdout", text=text)


def test_live_output_coalesces_to_one_chunk_per_interval() -> None:
    clock = Clock()
    live = LiveOutput(interval=0.1, clock=clock)
    assert live.take() is None  # nothing yet
    live.add(out("a"))
    assert live.take() == "a"  # the first chunk goes at once
    for i in range(50):  # a tight loop printing within one interval
        live.add(out(str(i % 10)))
        clock.now += 0.001
        assert live.take() is None
    clock.now += 0.1
    assert live.take() == "0123456789" * 5
    assert live.chunks == 2
    assert live.take() is None


def test_live_output_forced_flush_and_what_counts_as_output() -> None:
    live = LiveOutput(interval=10, clock=Clock())
    live.add(out("x"))
    assert live.take() == "x"
    live.add(StatusEvent(execution_id="e1", status=ExecutionStatus.RUNNING))
    live.add(ResultEvent(execution_id="e1", data={"text/plain": "42"}))
    live.add(
        ErrorEvent(execution_id="e1", error=CellError(name="ValueError", value="bad", traceback=[]))
    )
    assert live.take() is None  # within the interval
    assert live.take(force=True) == "42\nValueError: bad\n"
    assert "".join(live.seen) == "x42\nValueError: bad\n"


def test_live_output_keeps_the_tail_of_a_huge_chunk() -> None:
    live = LiveOutput(clock=Clock())
    live.add(out("h" * 10_000 + "END"))
    chunk = live.take()
    assert chunk is not None and chunk.endswith("END") and len(chunk) < 5000


def test_input_becomes_a_text_field_and_confirm_a_checkbox() -> None:
    message, schema = elicitation_for("name? ")
    assert "name? " in message and schema["required"] == ["value"]
    assert schema["properties"]["value"]["type"] == "string"
    message, schema = elicitation_for("delete all files? [y/N] ")
    assert message.endswith("delete all files?")
    assert schema["properties"]["answer"]["type"] == "boolean"


@pytest.mark.parametrize(
    ("prompt", "action", "content", "expected"),
    [
        ("name? ", "accept", {"value": "Ada"}, "Ada"),
        ("name? ", "decline", None, ""),
        ("name? ", "cancel", None, ""),
        ("name? ", "accept", {"value": 3}, ""),
        ("go? [y/N] ", "accept", {"answer": True}, "y"),
        ("go? [y/N] ", "accept", {"answer": False}, "n"),
        ("go? [y/N] ", "decline", None, ""),
    ],
)
def test_the_answer_input_gets(
    prompt: str, action: str, content: dict[str, object] | None, expected: str
) -> None:
    assert answer_of(prompt, action, content) == expected


def test_idle_handles() -> None:
    used = {"a": 10.0, "b": 50.0, "c": 89.9}
    assert idle_handles(used, 100.0, 50.0) == ["a", "b"]
    assert idle_handles(used, 100.0, None) == []
    assert idle_handles({}, 100.0, 1.0) == []
