"""The E2B wire shapes, with data: events to the code interpreter's NDJSON lines (parsed by
the SDK's own parser when it is installed), paths, listings, sandbox records."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from kernelhub.errors import InvalidRequestError, KernelError
from kernelhub.gateway import e2b_wire as wire
from kernelhub.models import (
    CellError,
    DisplayEvent,
    EndedBy,
    ErrorEvent,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    ResultEvent,
    StatusEvent,
    StreamEvent,
)

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def final(status: ExecutionStatus, **record: object) -> FinalEvent:
    return FinalEvent(
        execution_id="e1",
        record=ExecutionRecord(
            execution_id="e1", status=status, ended_by=EndedBy.REPLY, queued_at=NOW,
            finished_at=NOW, **record,  # type: ignore[arg-type]
        ),
    )  # fmt: skip


def test_result_formats_map_to_the_sdks_attributes() -> None:
    line = wire.result_line(
        {"text/plain": "fig", "image/png": "iVBO\nRw==\n", "text/html": "<b/>", "x/custom": 1},
        main=False,
    )
    assert line == {
        "type": "result", "is_main_result": False, "text": "fig", "png": "iVBORw==",
        "html": "<b/>", "extra": {"x/custom": 1},
    }  # fmt: skip


def test_events_become_lines_and_bookkeeping_none() -> None:
    out = wire.execute_lines(StreamEvent(execution_id="e1", name="stderr", text="warn\n"))
    assert out[0]["type"] == "stderr" and out[0]["text"] == "warn\n" and out[0]["timestamp"]
    error = CellError(name="ValueError", value="bad", traceback=["line 1", "line 2"])
    assert wire.execute_lines(ErrorEvent(execution_id="e1", error=error)) == [
        {"type": "error", "name": "ValueError", "value": "bad", "traceback": "line 1\nline 2"}
    ]
    assert wire.execute_lines(ResultEvent(execution_id="e1", data={"text/plain": "2"})) == [
        {"type": "result", "is_main_result": True, "text": "2"}
    ]
    update = DisplayEvent(execution_id="e1", data={"text/plain": "x"}, update=True)
    assert wire.execute_lines(update) == []
    assert wire.execute_lines(StatusEvent(execution_id="e1", status=ExecutionStatus.RUNNING)) == []


def test_final_reports_the_count_and_says_why_a_cell_did_not_finish() -> None:
    assert wire.execute_lines(final(ExecutionStatus.COMPLETED, execution_count=3)) == [
        {"type": "number_of_executions", "execution_count": 3}
    ]
    timed_out = wire.execute_lines(final(ExecutionStatus.TIMED_OUT, reason="timed out after 5 s"))
    assert timed_out == [
        {"type": "error", "name": "timed_out", "value": "timed out after 5 s",
         "traceback": "timed out after 5 s"},
    ]  # fmt: skip


def test_lines_parse_with_the_sdks_own_parser() -> None:
    models = pytest.importorskip("e2b_code_interpreter.models")
    execution = models.Execution()
    events = [
        StreamEvent(execution_id="e1", name="stdout", text="hi\n"),
        DisplayEvent(execution_id="e1", data={"text/plain": "<Figure>", "image/png": "iVBO"}),
        ErrorEvent(execution_id="e1", error=CellError(name="E", value="v", traceback=["t"])),
        final(ExecutionStatus.FAILED, execution_count=7),
    ]
    for event in events:
        for line in wire.execute_lines(event):
            models.parse_output(execution, json.dumps(line))
    assert execution.logs.stdout == ["hi\n"]
    assert execution.results[0].png == "iVBO" and not execution.results[0].is_main_result
    assert (execution.error.name, execution.error.value, execution.error.traceback) == (
        "E",
        "v",
        "t",
    )
    assert execution.execution_count == 7


@pytest.mark.parametrize(
    ("given", "relative"),
    [
        ("a.txt", "a.txt"),
        ("./d/a.txt", "d/a.txt"),
        ("/workspace/d/a.txt", "d/a.txt"),
        ("/home/user/a.txt", "a.txt"),
        ("/workspace", ""),
        ("/home/user/", ""),
        ("", ""),
    ],
)
def test_paths_map_into_the_workspace(given: str, relative: str) -> None:
    assert wire.workspace_path(given) == relative


@pytest.mark.parametrize(
    "bad", ["/etc/passwd", "/workspacex/a", "../a", "d/../../a", "/home/user/../x"]
)
def test_paths_outside_the_workspace_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequestError, match="/workspace"):
        wire.workspace_path(bad)


def test_listing_expression_runs_and_parses(tmp_path: object) -> None:
    """The expression is real Python: evaluate it here (on a temp dir standing in for
    /workspace) and feed its repr back the way the kernel's user_expressions would."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        os.makedirs(f"{root}/d/e")
        with open(f"{root}/d/f.txt", "w") as f:
            f.write("12345")
        os.symlink("/etc", f"{root}/d/link")
        expression = wire.list_expression("d", 1).replace(repr("/workspace/d"), repr(f"{root}/d"))
        value = eval(expression)
        entries = wire.listing({"ls": {"status": "ok", "data": {"text/plain": repr(value)}}})
        assert entries is not None
        infos = {e["name"]: wire.entry_info(e) for e in entries}
        assert set(infos) == {"e", "f.txt", "link"}  # depth 1: not d/e's contents
        assert infos["f.txt"]["size"] == "5" and infos["f.txt"]["type"] == "FILE_TYPE_FILE"
        assert infos["e"]["type"] == "FILE_TYPE_DIRECTORY"
        assert infos["e"]["permissions"].startswith("d")
        assert infos["link"].get("isSymlink") is True
        missing = eval(wire.list_expression("nope", 1).replace("/workspace", root))
        assert wire.listing({"ls": {"status": "ok", "data": {"text/plain": repr(missing)}}}) is None


def test_listing_failure_is_a_kernel_error() -> None:
    with pytest.raises(KernelError, match="NameError"):
        wire.listing({"ls": {"status": "error", "evalue": "NameError: os"}})


def test_sandbox_record_has_what_the_sdk_parses() -> None:
    models = pytest.importorskip("e2b.api.client.models")
    record = wire.sandbox_record(
        sandbox_id="s1", template="code-interpreter-v1", started_at=NOW, end_at=NOW,
        limits={"memory_bytes": 512 * 2**20, "cpus": 1.5, "disk_bytes": None},
        metadata={"k": "v"}, token="tok",
    )  # fmt: skip
    listed = models.ListedSandbox.from_dict(record)
    assert (listed.sandbox_id, listed.memory_mb, listed.cpu_count) == ("s1", 512, 2)
    detail = models.SandboxDetail.from_dict(record)
    assert detail.envd_access_token == "tok" and detail.end_at == NOW
    created = models.Sandbox.from_dict(record)
    assert created.envd_version == wire.ENVD_VERSION


def test_stat_expression_finds_one_entry_or_none() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        with open(f"{root}/f", "w") as f:
            f.write("abc")
        found = eval(wire.stat_expression("f").replace("/workspace", root))
        entries = wire.listing({"ls": {"status": "ok", "data": {"text/plain": repr(found)}}})
        assert entries is not None and [wire.entry_info(e)["size"] for e in entries] == ["3"]
        gone = eval(wire.stat_expression("g").replace("/workspace", root))
        assert gone == "null"


def test_metadata_filter_reads_the_sdks_query() -> None:
    from urllib.parse import quote, urlencode

    sent = urlencode({quote("team name"): quote("a&b=c"), "k": "v"})  # as the SDK builds it
    assert wire.metadata_filter(sent) == {"team name": "a&b=c", "k": "v"}
    assert wire.metadata_filter(None) == {}
