"""Notebook export from hand-built events: Jupyter's output semantics, kernelhub's
metadata and markers, and an HTML page that never carries agent output raw."""

from __future__ import annotations

import base64
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import nbformat
from pydantic import BaseModel

from kernelhub.export import RERUN_SKIP_TAG, to_html, to_notebook
from kernelhub.models import (
    CellError,
    ClearOutputEvent,
    DisplayEvent,
    EndedBy,
    ErrorEvent,
    Event,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    InputReplyEvent,
    InputRequestEvent,
    NoticeEvent,
    ResultEvent,
    StatusEvent,
    StreamEvent,
    TruncatedEvent,
)
from kernelhub.wire import SessionInfo, SessionState

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake").decode()


class Row(BaseModel):
    id: str
    code: str
    status: ExecutionStatus
    created_at: datetime
    record: ExecutionRecord | None


SESSION = SessionInfo(
    id="ses_1",
    owner="alice",
    state=SessionState.READY,
    backend="docker",
    created_at=T0,
    limits={"cell_timeout": 30.0},
    metadata={"agent": "a1"},
)


def execution(
    eid: str, code: str, events: list[Any], status: ExecutionStatus = ExecutionStatus.COMPLETED,
    ended_by: EndedBy = EndedBy.REPLY, count: int | None = 1, **record: Any,
) -> tuple[Row, list[Event]]:  # fmt: skip
    rec = ExecutionRecord(
        execution_id=eid, status=status, ended_by=ended_by, execution_count=count,
        queued_at=T0, started_at=T0, finished_at=T0 + timedelta(seconds=2), duration=2.0,
        cpu_seconds=0.5, peak_memory_bytes=10_000_000, output_bytes=12, **record,
    )  # fmt: skip
    seq = iter(range(1, 1000))
    built = [
        e.model_copy(update={"execution_id": eid, "seq": next(seq)})
        for e in [StatusEvent(execution_id=eid, status=ExecutionStatus.RUNNING), *events]
    ]
    built.append(FinalEvent(execution_id=eid, seq=next(seq), record=rec))
    return Row(id=eid, code=code, status=status, created_at=T0, record=rec), built


def out(name: str, text: str) -> StreamEvent:
    return StreamEvent(execution_id="", name=name, text=text)  # type: ignore[arg-type]


def cells(nb: Any) -> dict[str, Any]:
    return {c.metadata["kernelhub"]["execution_id"]: c for c in nb.cells if c.cell_type == "code"}


def build() -> Any:
    return to_notebook(
        SESSION,
        [
            execution(
                "ex_1",
                "print('a'); print('b'); 6 * 7",
                [
                    out("stdout", "a\n"),
                    out("stderr", "warn\n"),
                    out("stdout", "b\n"),
                    out("stdout", "c\n"),
                    ResultEvent(execution_id="", data={"text/plain": "42"}, execution_count=1),
                ],
            ),
            execution(
                "ex_2",
                "plot and progress",
                [
                    DisplayEvent(
                        execution_id="",
                        data={"image/png": PNG, "text/plain": "<Figure>"},
                        display_id="d1",
                    ),
                    out("stdout", "10%\n"),
                    ClearOutputEvent(execution_id="", wait=True),
                    out("stdout", "50%\n"),
                    ClearOutputEvent(execution_id="", wait=True),
                    out("stdout", "100%\n"),
                    ClearOutputEvent(execution_id="", wait=False),
                    DisplayEvent(execution_id="", data={"text/plain": "first"}, display_id="p"),
                ],
                count=2,
            ),
            execution(
                "ex_3",
                "update",
                [
                    DisplayEvent(
                        execution_id="", data={"text/plain": "second"}, display_id="p", update=True
                    ),
                    TruncatedEvent(execution_id="", limit_bytes=1024, dropped_bytes=10),
                    TruncatedEvent(execution_id="", limit_bytes=1024, dropped_bytes=99, final=True),
                    NoticeEvent(execution_id="", message="dropped an oversized message"),
                ],
                count=3,
                dropped_bytes=99,
            ),
            execution(
                "ex_4",
                "1 / 0",
                [
                    ErrorEvent(
                        execution_id="",
                        error=CellError(
                            name="ZeroDivisionError",
                            value="division by zero",
                            traceback=["\x1b[31mZeroDivisionError\x1b[0m: division by zero"],
                        ),
                    )
                ],
                status=ExecutionStatus.FAILED,
                count=4,
                error=CellError(name="ZeroDivisionError", value="division by zero"),
            ),
            execution(
                "ex_5",
                "time.sleep(60)",
                [out("stdout", "sleeping\n")],
                status=ExecutionStatus.TIMED_OUT,
                ended_by=EndedBy.INTERRUPT,
                count=5,
                reason="execution timed out after 2 s",
            ),
            execution(
                "ex_6",
                "name = input('name? ')",
                [
                    InputRequestEvent(execution_id="", prompt="name? "),
                    StatusEvent(execution_id="", status=ExecutionStatus.AWAITING_INPUT),
                    InputReplyEvent(execution_id="", value="Ada", answered_by="alice"),
                    out("stdout", "hi Ada\n"),
                ],
                count=6,
            ),
        ],
    )


def test_the_notebook_validates_and_keeps_order_and_counts() -> None:
    nb = build()
    nbformat.validate(nb)
    nbformat.validate(nbformat.reads(nbformat.writes(nb), as_version=4))
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.metadata["kernelhub"]["execution_id"] for c in code] == [
        f"ex_{i}" for i in range(1, 7)
    ]
    assert [c.execution_count for c in code] == [1, 2, 3, 4, 5, 6]
    assert nb.metadata.kernelhub["session_id"] == "ses_1"
    assert nb.metadata.kernelspec["name"] == "python3"


def test_streams_merge_per_name_and_results_keep_their_count() -> None:
    c = cells(build())["ex_1"]
    assert [(o.output_type, o.get("name"), o.get("text")) for o in c.outputs[:3]] == [
        ("stream", "stdout", "a\n"),
        ("stream", "stderr", "warn\n"),
        ("stream", "stdout", "b\nc\n"),
    ]
    assert c.outputs[3].output_type == "execute_result"
    assert c.outputs[3].data == {"text/plain": "42"} and c.outputs[3].execution_count == 1
    k = c.metadata["kernelhub"]
    assert k["status"] == "completed" and k["ended_by"] == "reply"
    assert k["timings"]["duration"] == 2.0 and k["timings"]["started_at"] == "2024-05-01T12:00:00Z"
    assert k["resources"] == {
        "cpu_seconds": 0.5, "peak_memory_bytes": 10_000_000, "output_bytes": 12, "dropped_bytes": 0,
    }  # fmt: skip
    assert "tags" not in c.metadata


def test_clear_output_follows_jupyter_and_updates_reach_earlier_cells() -> None:
    nb = build()
    c = cells(nb)["ex_2"]
    # wait=True cleared on the next output; wait=False at once: only the last display stays,
    # and the later cell's update_display_data rewrote it.
    assert [o.output_type for o in c.outputs] == ["display_data"]
    assert c.outputs[0].data == {"text/plain": "second"}
    assert all(o.output_type != "display_data" for o in cells(nb)["ex_3"].outputs)


def test_clear_output_wait_with_nothing_after_keeps_the_outputs() -> None:
    nb = to_notebook(
        SESSION,
        [
            execution(
                "ex_1", "x", [out("stdout", "kept\n"), ClearOutputEvent(execution_id="", wait=True)]
            )
        ],
    )
    assert [o.text for o in cells(nb)["ex_1"].outputs] == ["kept\n"]


def test_display_keeps_the_full_mime_bundle() -> None:
    nb = to_notebook(
        SESSION,
        [execution("ex_1", "plot", [DisplayEvent(
            execution_id="", data={"image/png": PNG, "text/plain": "<Figure>"},
            metadata={"image/png": {"width": 10}},
        )])],
    )  # fmt: skip
    (display,) = cells(nb)["ex_1"].outputs
    assert display.data == {"image/png": PNG, "text/plain": "<Figure>"}
    assert display.metadata == {"image/png": {"width": 10}}


def test_truncation_and_notices_are_visible_and_in_metadata() -> None:
    c = cells(build())["ex_3"]
    k = c.metadata["kernelhub"]
    assert k["truncation"] == {"limit_bytes": 1024, "dropped_bytes": 99}
    assert k["notices"] == ["dropped an oversized message"]
    assert k["resources"]["dropped_bytes"] == 99
    text = "".join(o.text for o in c.outputs if o.output_type == "stream")
    assert "[kernelhub: output truncated at the 1024-byte cap]" in text
    assert "[kernelhub: dropped an oversized message]" in text


def test_an_error_is_an_error_output_and_marked() -> None:
    nb = build()
    c = cells(nb)["ex_4"]
    (error,) = c.outputs
    assert (error.output_type, error.ename, error.evalue) == (
        "error", "ZeroDivisionError", "division by zero",
    )  # fmt: skip
    assert c.metadata["tags"] == [RERUN_SKIP_TAG, "raises-exception"]
    marker = nb.cells[nb.cells.index(c) - 1]
    assert marker.cell_type == "markdown" and "the cell below: failed" in marker.source


def test_a_timeout_is_marked_where_a_reader_sees_it() -> None:
    nb = build()
    c = cells(nb)["ex_5"]
    assert c.outputs[-1].name == "stderr"
    assert c.outputs[-1].text.startswith("[kernelhub: timed out after 2.0 s (ended by interrupt)")
    assert "execution timed out after 2 s" in c.outputs[-1].text
    marker = nb.cells[nb.cells.index(c) - 1]
    assert "timed out after 2.0 s" in marker.source and "kernelhub-marker" in marker.metadata.tags
    assert c.metadata["tags"] == [RERUN_SKIP_TAG]
    assert c.metadata["kernelhub"]["status"] == "timed_out"
    assert c.metadata["kernelhub"]["ended_by"] == "interrupt"


def test_input_requests_and_their_answers() -> None:
    c = cells(build())["ex_6"]
    assert c.metadata["kernelhub"]["inputs"] == [
        {"prompt": "name? ", "password": False, "value": "Ada", "answered_by": "alice"}
    ]
    assert c.outputs[0].text == "name? Ada\nhi Ada\n"
    assert c.metadata["tags"] == [RERUN_SKIP_TAG]


def test_an_unfinished_execution_is_marked() -> None:
    row = Row(id="ex_9", code="work()", status=ExecutionStatus.RUNNING, created_at=T0, record=None)
    nb = to_notebook(SESSION, [(row, [out("stdout", "partial\n")])])
    nbformat.validate(nb)
    c = cells(nb)["ex_9"]
    assert c.outputs[-1].text == "[kernelhub: was still running when exported]\n"
    assert c.execution_count is None


def test_odd_mime_values_still_validate() -> None:
    nb = to_notebook(
        SESSION,
        [execution("ex_1", "x", [DisplayEvent(
            execution_id="", data={"text/plain": ["a", "b"], "text/x-odd": 3,
                                   "application/vnd.thing+json": {"k": [1]}},
        )])],
    )  # fmt: skip
    nbformat.validate(nb)
    assert cells(nb)["ex_1"].outputs[0].data["text/plain"] == "ab"


def test_html_shows_everything_and_never_injects_agent_html() -> None:
    hostile = '<script>alert("x")</script><img src=x onerror=alert(1)><b>bold</b>'
    nb = build()
    nb.cells.append(
        to_notebook(
            SESSION,
            [execution("ex_7", "display(HTML(...)) </pre><script>1</script>", [
                DisplayEvent(execution_id="", data={"text/html": hostile, "text/plain": "x"}),
                out("stdout", "<script>evil()</script>\n"),
                DisplayEvent(execution_id="", data={"image/png": 'AAAA" onload="alert(1)'}),
                DisplayEvent(execution_id="", data={"image/png": PNG, "text/plain": "<Figure>"}),
                DisplayEvent(execution_id="", data={"image/svg+xml": "<svg><script>1</script></svg>"}),
            ])],
        ).cells[-1]
    )  # fmt: skip
    page = to_html(nb)
    assert "<script" not in page.lower()
    assert "<img src=x" not in page and 'onload="' not in page and "<b>bold" not in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    # The HTML output is there, escaped, inside a sandboxed frame only.
    frames = re.findall(r'<iframe sandbox="" [^>]*srcdoc="([^"]*)"', page)
    assert frames and "&lt;b&gt;bold&lt;/b&gt;" in frames[0]
    assert f'src="data:image/png;base64,{PNG}"' in page
    assert "\x1b[" not in page and "ZeroDivisionError: division by zero" in page
    assert "timed out" in page and 'class="banner"' in page
    assert "&lt;script&gt;evil()&lt;/script&gt;" in page


def test_an_interrupt_is_marked_next_to_its_keyboard_interrupt() -> None:
    kbi = CellError(name="KeyboardInterrupt", value="", traceback=["KeyboardInterrupt: "])
    nb = to_notebook(
        SESSION,
        [execution("ex_1", "time.sleep(60)", [ErrorEvent(execution_id="", error=kbi)],
                   status=ExecutionStatus.INTERRUPTED, ended_by=EndedBy.INTERRUPT)],
    )  # fmt: skip
    c = cells(nb)["ex_1"]
    assert [o.output_type for o in c.outputs] == ["error", "stream"]
    assert c.outputs[-1].text == "[kernelhub: interrupted]\n"
    assert c.metadata["tags"] == [RERUN_SKIP_TAG]
    assert "the cell below: interrupted" in nb.cells[nb.cells.index(c) - 1].source


def _shifted(pair: tuple[Row, list[Event]], by: int) -> tuple[Row, list[Event]]:
    row, events = pair
    return row, [e.model_copy(update={"seq": e.seq + by}) for e in events]


def test_counts_keep_going_up_across_a_recovery_shown_as_its_own_cell() -> None:
    died = execution("e2", "boom()", [], ExecutionStatus.KERNEL_DIED, EndedBy.KERNEL_DEATH, 2)
    recovery = NoticeEvent(execution_id="", seq=150, message="the kernel died (oom); recovered")
    runs = [
        _shifted(execution("e1", "a = 1", [], count=1), 0),
        _shifted(died, 100),
        _shifted(execution("e3", "a", [ResultEvent(execution_id="", data={"text/plain": "1"}, execution_count=1)], count=1), 200),
        _shifted(execution("e4", "b = 2", [], count=2), 300),
    ]  # fmt: skip
    nb = to_notebook(SESSION, runs, [recovery])
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == [1, 2, 3, 4]
    assert code[2].outputs[0].execution_count == 3
    assert code[2].metadata.kernelhub.kernel_execution_count == 1
    order = [c.metadata.get("kernelhub", {}).get("execution_id") or c.source for c in nb.cells]
    note = order.index("**⚠ kernelhub — the kernel died \\(oom\\); recovered**")
    assert order.index("e2") < note < order.index("e3")
    assert RERUN_SKIP_TAG not in nb.cells[note].metadata.get("tags", [])
    page = to_html(nb)
    assert "<strong>⚠ kernelhub — the kernel died (oom); recovered</strong>" in page
    assert re.findall(r"In \[(\d+)\]", page) == ["1", "2", "3", "4"]
