from __future__ import annotations

import itertools
import json
from typing import Any

from kernelhub.execution.collector import (
    ERROR_TRACEBACK_BYTES,
    ERROR_VALUE_BYTES,
    WIRE_BYTES_KEY,
    OutputCollector,
)
from kernelhub.models import (
    ClearOutputEvent,
    DisplayEvent,
    ErrorEvent,
    InputRequestEvent,
    NoticeEvent,
    ResultEvent,
    StreamEvent,
    TruncatedEvent,
)


def msg(msg_type: str, **content: Any) -> dict[str, Any]:
    return {"header": {"msg_type": msg_type}, "parent_header": {"msg_id": "m"}, "content": content}


def collector(limit: int = 1000, *, events: int = 10_000, tail: int = 0) -> OutputCollector:
    counter = itertools.count(1)
    return OutputCollector(
        "e1", "m", limit_bytes=limit, limit_events=events, tail_bytes=tail,
        next_seq=lambda: next(counter),
    )  # fmt: skip


def stdout(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, StreamEvent) and e.name == "stdout")


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
    assert [type(e) for e in events] == [DisplayEvent, TruncatedEvent]
    assert "dropped" in events[0].data["text/plain"], "a visible mark in its place"
    assert c.dropped_bytes == len(json.dumps({"data": {"image/png": "x" * 50}}))
    assert c.dropped_events == 1


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


def test_display_metadata_is_charged_not_only_its_data() -> None:
    c = collector(limit=10_000)
    big = {"k": "m" * 40_000}
    kept = c.feed(msg("display_data", data={"text/plain": "x"}, metadata={}))
    events = [
        e
        for _ in range(10)
        for e in c.feed(msg("display_data", data={"text/plain": "x"}, metadata=big))
    ]
    assert isinstance(kept[0], DisplayEvent)
    assert not any(isinstance(e, DisplayEvent) and e.metadata for e in events)
    assert c.output_bytes <= 10_000
    assert c.dropped_events == 10 and c.dropped_bytes > 400_000


def test_the_wire_size_from_the_receive_path_is_what_is_charged() -> None:
    c = collector(limit=5000)
    m = msg("clear_output", wait=False)
    m[WIRE_BYTES_KEY] = 4000
    assert [type(e) for e in c.feed(m)] == [ClearOutputEvent]
    assert c.output_bytes == 4000
    assert [type(e) for e in c.feed(m)] == [TruncatedEvent]
    assert c.dropped_bytes == 4000


def test_head_and_tail_are_kept_around_a_marker() -> None:
    c = collector(limit=1000, tail=100)
    lines = [f"line {i:05d}\n" for i in range(1000)]  # 11 bytes each
    events: list[Any] = []
    for line in lines:
        events += c.feed(msg("stream", name="stdout", text=line))
    events += c.finish()
    text = stdout(events)
    everything = "".join(lines)
    assert text.startswith(everything[:900])
    assert text.endswith(everything[-100:]), "the last lines are there"
    dropped = len(everything) - 1000
    assert f"[... {dropped} bytes dropped ...]" in text
    assert c.dropped_bytes == dropped and c.output_bytes == 1000
    final = [e for e in events if isinstance(e, TruncatedEvent)]
    assert [f.final for f in final] == [False, True] and final[-1].dropped_bytes == dropped


def test_one_huge_chunk_keeps_its_own_end() -> None:
    c = collector(limit=2000, tail=500)
    text = "".join(chr(ord("a") + i % 26) for i in range(100_000))
    events = c.feed(msg("stream", name="stderr", text=text)) + c.finish()
    kept = "".join(e.text for e in events if isinstance(e, StreamEvent))
    assert kept.startswith(text[:1500]) and kept.endswith(text[-500:])
    assert c.dropped_bytes == 100_000 - 2000


def test_tail_keeps_stdout_and_stderr_in_order() -> None:
    c = collector(limit=1024, tail=64)
    events = c.feed(msg("stream", name="stdout", text="h" * 2000))
    events += c.feed(msg("stream", name="stdout", text="out-end\n"))
    events += c.feed(msg("stream", name="stderr", text="err-end\n"))
    events += c.finish()
    streams = [(e.name, e.text) for e in events if isinstance(e, StreamEvent)]
    assert streams[-1] == ("stderr", "err-end\n")
    assert streams[-2][0] == "stdout" and streams[-2][1].endswith("hhout-end\n")
    assert "bytes dropped" in streams[-3][1]


def test_event_cap_bounds_clear_output_and_tiny_prints() -> None:
    c = collector(limit=10**9, events=100, tail=1000)
    events: list[Any] = []
    for i in range(10_000):
        events += c.feed(msg("clear_output", wait=True))
        events += c.feed(msg("stream", name="stdout", text=f"{i}\n"))
    events += c.finish()
    assert len(events) <= 100 + 4
    assert c.dropped_events >= 10_000 - 100
    assert stdout(events).endswith("9998\n9999\n"), "the end survives the event cap"


def test_errors_are_bounded_and_every_one_is_charged() -> None:
    c = collector(limit=10 * 2**20)
    huge = "x" * 5_000_000 + "THE END"
    (event,) = c.feed(
        msg("error", ename="Exception", evalue=huge, traceback=["frame " * 10**5] * 1000)
    )
    assert isinstance(event, ErrorEvent)
    assert len(event.error.value) <= ERROR_VALUE_BYTES and event.error.value.endswith("THE END")
    assert "bytes dropped" in event.error.value
    assert sum(len(line) for line in event.error.traceback) <= ERROR_TRACEBACK_BYTES + 100
    assert "frames dropped" in event.error.traceback[0]
    assert c.error == event.error
    assert c.dropped_bytes > 5_000_000 + 90 * 10**6, "what was cut is counted"
    first = c.output_bytes
    for _ in range(1000):
        c.feed(msg("error", ename="E", evalue="y" * 100_000, traceback=[]))
    assert c.output_bytes <= 10 * 2**20 and c.dropped_events > 0
    assert first > 0 and c.error is not None and c.error.name == "E"


def test_a_coloured_traceback_under_the_cap_drops_nothing() -> None:
    # The plain twin of a coloured traceback is derived, not a cut: nothing was dropped.
    c = collector(limit=10 * 2**20)
    coloured = ["\x1b[31mKeyError\x1b[0m: 'missing'", "\x1b[32mCell In[2], line 4\x1b[0m"]
    (event,) = c.feed(msg("error", ename="KeyError", evalue="'missing'", traceback=coloured))
    assert isinstance(event, ErrorEvent) and "\x1b" not in "".join(event.error.traceback)
    assert event.error.traceback_ansi == coloured
    assert (c.dropped_bytes, c.dropped_events) == (0, 0)


def test_prompts_are_cut_and_charged_but_never_dropped() -> None:
    c = collector(limit=1024)
    c.feed(msg("stream", name="stdout", text="z" * 1024))
    (event, *_) = c.feed(msg("input_request", prompt="p" * 100_000, password=False))
    assert isinstance(event, InputRequestEvent) and len(event.prompt) < 5000


def test_comm_messages_count_against_the_cap() -> None:
    c = collector(limit=2000)
    for _ in range(10):
        assert all(
            isinstance(e, TruncatedEvent)
            for e in c.feed(msg("comm_msg", comm_id="c", data={"v": "q" * 500}))
        )
    assert c.output_bytes <= 2000 and c.dropped_events > 0


def test_an_oversized_message_becomes_a_named_notice() -> None:
    c = collector()
    events = c.oversized(50_000_000, 8 * 2**20)
    assert isinstance(events[0], NoticeEvent) and "50000000 bytes" in events[0].message
    assert c.dropped_bytes == 50_000_000 and c.dropped_events == 1


def test_late_output_past_the_cap_is_dropped_not_tailed() -> None:
    c = collector(limit=1024, tail=100)
    c.feed(msg("execute_reply", status="ok"))
    c.feed(msg("status", execution_state="idle"))
    c.finish()
    events = c.feed(msg("stream", name="stdout", text="w" * 5000))
    assert stdout(events) == "w" * 1024
    assert c.finish()[-1].dropped_bytes == 5000 - 1024


def test_output_between_cells_has_a_budget_of_its_own() -> None:
    counter = itertools.count(1)
    c = OutputCollector.between_cells(
        limit_bytes=1024, limit_events=16, next_seq=lambda: next(counter)
    )
    events = [e for _ in range(100) for e in c.feed(msg("stream", name="stdout", text="b" * 100))]
    streams = [e for e in events if isinstance(e, StreamEvent)]
    assert all(e.late and e.execution_id == "" for e in streams)
    assert sum(len(e.text) for e in streams) == 1024 and c.dropped_bytes == 100 * 100 - 1024


def test_what_a_stream_message_carries_besides_its_text_is_counted() -> None:
    c = collector()
    m = msg("stream", name="stdout", text="hi")
    m[WIRE_BYTES_KEY] = 5_000_000
    (event,) = c.feed(m)
    assert isinstance(event, StreamEvent) and event.text == "hi"
    assert c.output_bytes == 2 and c.dropped_bytes == 5_000_000 - 2


def test_what_the_sandbox_cut_before_sending_counts_as_dropped() -> None:
    c = collector(limit=10**6)
    note = {"original_bytes": 40_000_000, "limit_bytes": 8 * 2**20}
    m = msg("display_data", data={"text/plain": "x"}, metadata={}, kernelhub_truncated=note)
    m[WIRE_BYTES_KEY] = 1000
    (event,) = c.feed(m)
    assert isinstance(event, DisplayEvent)
    assert c.output_bytes == 1000 and c.dropped_bytes == 40_000_000 - 1000


def test_a_message_that_breaks_the_parser_is_counted_not_raised() -> None:
    c = collector()
    assert c.feed(["not", "a", "mapping"]) == []  # type: ignore[arg-type]
    assert c.feed({"header": {"msg_type": "stream"}, "content": None}) == []
    assert c.malformed == 2
    (event,) = c.feed(msg("stream", name="stdout", text="still fine"))
    assert isinstance(event, StreamEvent) and event.text == "still fine"


def test_a_reset_connection_is_a_named_notice_announced_once() -> None:
    c = collector()
    notice, truncated = c.connection_reset("iopub", 8 * 2**20)
    assert isinstance(notice, NoticeEvent)
    assert "iopub connection was reset" in notice.message and f"{8 * 2**20}-byte" in notice.message
    assert isinstance(truncated, TruncatedEvent) and not truncated.final
    assert truncated.dropped_events == 1 and truncated.dropped_bytes == 0
    (again,) = c.connection_reset("shell", 1024)  # the truncation was announced already
    assert isinstance(again, NoticeEvent) and "shell" in again.message
    assert c.resets == 2 and c.dropped_events == 2
    assert c.finish()[-1].dropped_events == 2


def test_the_reply_carries_the_user_expressions() -> None:
    answers = {"x": {"status": "ok", "data": {"text/plain": "1"}, "metadata": {}}}
    c = collector()
    c.feed(msg("execute_reply", status="ok", user_expressions=answers))
    assert c.user_expressions == answers and c.reply_status == "ok"
    odd = collector()
    odd.feed(msg("execute_reply", status=None, user_expressions=["not", "a", "mapping"]))
    assert odd.user_expressions == {} and odd.reply_status == "error"


def test_past_the_event_cap_a_dropped_display_leaves_no_mark() -> None:
    c = collector(limit=10, events=1)
    assert [type(e) for e in c.feed(msg("display_data", data={"image/png": "x" * 50}))] == [
        DisplayEvent,
        TruncatedEvent,
    ]
    assert c.feed(msg("display_data", data={"image/png": "y" * 50})) == []
    assert c.dropped_events == 2


def test_a_dropped_result_leaves_no_mark_either() -> None:
    c = collector(limit=10)
    (truncated,) = c.feed(msg("execute_result", data={"text/plain": "z" * 50}, execution_count=1))
    assert isinstance(truncated, TruncatedEvent) and c.dropped_events == 1


def test_late_output_once_the_head_is_full_is_dropped_not_tailed() -> None:
    c = collector(limit=10, tail=5)
    c.feed(msg("stream", name="stdout", text="0123456789"))
    c.feed(msg("execute_reply", status="ok"))
    c.feed(msg("status", execution_state="idle"))
    assert stdout(c.finish()) == "56789"  # the tail, flushed once
    assert c.feed(msg("stream", name="stdout", text="late")) == []
    assert c.dropped_bytes == 4


def test_content_that_cannot_be_measured_is_still_converted() -> None:
    c = collector()
    content: dict[str, Any] = {"data": {"text/plain": "x"}, "metadata": {}}
    content["itself"] = content  # json.dumps: circular reference
    (event,) = c.feed({"header": {"msg_type": "display_data"}, "content": content})
    assert isinstance(event, DisplayEvent) and event.data == {"text/plain": "x"}
    assert c.malformed == 0


def test_an_error_whose_traceback_is_not_a_list_keeps_its_name() -> None:
    c = collector()
    (event,) = c.feed(msg("error", ename="E", evalue="v", traceback="not a list"))
    assert isinstance(event, ErrorEvent) and event.error.name == "E"
    assert event.error.traceback == []
