from __future__ import annotations

import itertools
from typing import Any

from kernelhub.execution.collector import OutputCollector
from kernelhub.models import (
    DisplayEvent,
    ErrorEvent,
    InputRequestEvent,
    ResultEvent,
    StreamEvent,
    TruncatedEvent,
)


def msg(msg_type: str, **content: Any) -> dict[str, Any]:
    return {"header": {"msg_type": msg_type}, "parent_header": {"msg_id": "m"}, "content": content}


def collector(limit: int = 1000) -> OutputCollector:
    counter = itertools.count(1)
    return OutputCollector("e1", "m", limit_bytes=limit, next_seq=lambda: next(counter))


def test_converts_each_output_kind() -> None:
    c = collector()
    events = []
    for m in [
        msg("status", execution_state="busy"),
        msg("execute_input", code="x", execution_count=3),
        msg("stream", name="stdout", text="hi\n"),
        msg("display_data", data={"image/png": "AAA", "text/plain": "<Figure>"}, metadata={}),
        msg("execute_result", data={"text/plain": "2"}, metadata={}, execution_count=3),
        msg("error", ename="ZeroDivisionError", evalue="division by zero", traceback=["tb"]),
        msg("input_request", prompt="name? ", password=False),
    ]:
        events += c.feed(m)
    kinds = [type(e) for e in events]
    assert kinds == [StreamEvent, DisplayEvent, ResultEvent, ErrorEvent, InputRequestEvent]
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert c.execution_count == 3
    assert c.error is not None and c.error.name == "ZeroDivisionError"
    assert not c.done
    c.feed(msg("execute_reply", status="error", execution_count=3))
    assert not c.done
    c.feed(msg("status", execution_state="idle"))
    assert c.done and c.reply_status == "error"


def test_cap_truncates_streams_and_announces_once_then_totals() -> None:
    c = collector(limit=10)
    first = c.feed(msg("stream", name="stdout", text="0123456789abc"))
    assert isinstance(first[0], StreamEvent) and first[0].text == "0123456789"
    assert isinstance(first[1], TruncatedEvent) and not first[1].final
    assert c.feed(msg("stream", name="stdout", text="more")) == []
    final = c.finish()
    assert len(final) == 1 and isinstance(final[0], TruncatedEvent)
    assert final[0].final and final[0].dropped_bytes == 3 + 4
    assert c.output_bytes == 10


def test_cap_never_splits_a_multibyte_character() -> None:
    c = collector(limit=5)
    (event, _) = c.feed(msg("stream", name="stdout", text="ééé"))
    assert isinstance(event, StreamEvent) and event.text == "éé"
    assert c.output_bytes == 4 and c.dropped_bytes == 2


def test_display_over_the_cap_is_dropped_whole() -> None:
    c = collector(limit=10)
    events = c.feed(msg("display_data", data={"image/png": "x" * 50}))
    assert [type(e) for e in events] == [TruncatedEvent]
    assert c.dropped_bytes == 50


def test_hostile_messages_are_skipped_not_raised() -> None:
    c = collector()
    bad = [
        {"header": "nope", "content": {}},
        {"header": {"msg_type": "stream"}, "content": "text"},
        msg("stream", name="stdin", text="x"),
        msg("stream", name="stdout", text=123),
        msg("display_data", data=["not", "a", "dict"]),
        msg("execute_result", data={1: "x"}),
        msg("error", ename=None),
        {"header": {"msg_type": "status"}},
    ]
    for m in bad:
        assert c.feed(m) == []
    assert c.malformed == len(bad)
    assert c.output_bytes == 0


def test_error_only_in_reply_is_kept_as_data() -> None:
    c = collector()
    c.feed(msg("execute_reply", status="error", ename="E", evalue="v", traceback=["a", "b"]))
    assert c.error is not None and c.error.traceback == ["a", "b"]


def test_output_after_the_cell_finished_is_marked_late() -> None:
    c = collector()
    c.feed(msg("execute_reply", status="ok"))
    c.feed(msg("status", execution_state="idle"))
    (event,) = c.feed(msg("stream", name="stdout", text="later"))
    assert isinstance(event, StreamEvent) and event.late
