"""What an Execution offers beside its typed events, from data: ``results`` (the shape of
e2b's ``run_code`` results) and ``CellError`` plain and coloured."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kernelhub.models import (
    CellError,
    ClearOutputEvent,
    DisplayEvent,
    EndedBy,
    Event,
    Execution,
    ExecutionRecord,
    ExecutionStatus,
    ResultEvent,
    StreamEvent,
)

NOW = datetime(2024, 1, 1, tzinfo=UTC)
PNG = "iVBORw0KGgo="


def execution(*events: Event) -> Execution:
    record = ExecutionRecord(
        execution_id="e7", status=ExecutionStatus.COMPLETED, ended_by=EndedBy.REPLY,
        queued_at=NOW, finished_at=NOW,
    )  # fmt: skip
    return Execution(record=record, events=list(events))


def display(data: dict[str, Any], **extra: Any) -> DisplayEvent:
    return DisplayEvent(execution_id="e7", data=data, **extra)


def test_results_have_one_entry_per_display_and_the_value_with_shortcuts() -> None:
    ex = execution(
        display({"image/png": PNG, "text/plain": "<Figure>"}, metadata={"image/png": {"width": 5}}),
        StreamEvent(execution_id="e7", name="stdout", text="between\n"),
        display(
            {"text/html": ["<b>", "x</b>"], "text/markdown": "**x**", "image/svg+xml": "<svg/>"}
        ),
        display({"application/json": {"a": [1]}, "image/jpeg": "/9j/", "text/latex": "$x$"}),
        ResultEvent(execution_id="e7", data={"text/plain": "42"}, execution_count=3),
    )
    assert ex.id == "e7"
    figure, rich, data, value = ex.results
    assert (
        figure.png == PNG
        and figure.text == "<Figure>"
        and figure.metadata["image/png"]["width"] == 5
    )
    assert not figure.is_main_result and figure.html is None and figure.jpeg is None
    assert rich.html == "<b>x</b>" and rich.markdown == "**x**" and rich.svg == "<svg/>"
    assert data.json == {"a": [1]} and data.jpeg == "/9j/" and data.latex == "$x$"
    assert data.formats() == ["application/json", "image/jpeg", "text/latex"]
    assert value.is_main_result and value.text == "42" and value.execution_count == 3
    assert value.data == {"text/plain": "42"} and ex.text == "42"


def test_results_follow_updates_and_clear_output_like_a_front_end() -> None:
    ex = execution(
        display({"text/plain": "old"}),
        ClearOutputEvent(execution_id="e7", wait=True),  # cleared when the next output comes
        display({"text/plain": "0%"}, display_id="bar"),
        display({"text/plain": "100%"}, display_id="bar", update=True),
        display({"text/plain": "other"}, display_id="other"),
    )
    assert [(r.text, r.display_id) for r in ex.results] == [("100%", "bar"), ("other", "other")]
    cleared = execution(display({"text/plain": "gone"}), ClearOutputEvent(execution_id="e7"))
    assert cleared.results == []
    assert execution().results == []


def test_cell_error_traceback_is_plain_with_the_coloured_one_beside_it() -> None:
    coloured = [
        "\x1b[31m----\x1b[39m",
        "\x1b[36mCell In[1], line 2\x1b[39m\n----> 2 d['x']",
        "KeyError: 'x'",
    ]
    error = CellError(name="KeyError", value="'x'", traceback=coloured)
    assert error.traceback == ["----", "Cell In[1], line 2\n----> 2 d['x']", "KeyError: 'x'"]
    assert error.traceback_ansi == coloured
    assert error.traceback_text == "----\nCell In[1], line 2\n----> 2 d['x']\nKeyError: 'x'"
    # Over the wire and back, and a record stored before traceback_ansi existed.
    assert CellError.model_validate_json(error.model_dump_json()) == error
    old = CellError.model_validate({"name": "KeyError", "value": "'x'", "traceback": coloured})
    assert old == error
    only_ansi = CellError.model_validate({"name": "E", "value": "", "traceback_ansi": coloured})
    assert only_ansi.traceback == error.traceback
    assert CellError(name="E", value="v").traceback_text == "E: v"
