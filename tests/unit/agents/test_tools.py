"""The tool definitions and result shaping, with data and a tiny fake session (the real
session is exercised in tests/gateway/test_agents.py)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from kernelhub.agents.results import (
    render_execution,
    strip_ansi,
    summarize_error,
    trim_traceback,
    truncate,
)
from kernelhub.agents.tools import TOOLS, ToolRunner, anthropic_tools, openai_tools
from kernelhub.client import FileInfo, NotFoundError
from kernelhub.models import (
    CellError,
    DisplayEvent,
    EndedBy,
    ErrorEvent,
    Event,
    Execution,
    ExecutionRecord,
    ExecutionStatus,
    ResultEvent,
    StreamEvent,
)
from kernelhub.wire import SnapshotInfo

NOW = datetime(2025, 1, 1, tzinfo=UTC)
PNG = base64.b64encode(b"\x89PNG fake").decode()


def execution(
    *events: Event,
    status: ExecutionStatus = ExecutionStatus.COMPLETED,
    error: CellError | None = None,
    **record: Any,
) -> Execution:
    return Execution(
        record=ExecutionRecord(
            execution_id="e1", status=status, ended_by=EndedBy.REPLY, error=error,
            queued_at=NOW, finished_at=NOW, **record,
        ),
        events=list(events),
    )  # fmt: skip


def out(text: str, name: str = "stdout") -> StreamEvent:
    return StreamEvent(execution_id="e1", name=name, text=text)  # type: ignore[arg-type]


class FakeSession:
    """Answers run() with a canned Execution and records what it was asked."""

    def __init__(self, result: Execution | None = None) -> None:
        self.result = result or execution(out("hi\n"))
        self.calls: list[tuple[str, Any]] = []
        self.files: dict[str, bytes] = {}

    async def run(
        self, code: str, *, timeout: float | None = None,
        on_event: Callable[[Event], object] | None = None,
    ) -> Execution:  # fmt: skip
        self.calls.append(("run", (code, timeout)))
        for event in self.result.events:
            if on_event is not None:
                on_event(event)
        return self.result

    async def upload(self, path: str, data: bytes) -> FileInfo:
        self.files[path] = data
        return FileInfo(path=path, size=len(data))

    async def download(self, path: str) -> bytes:
        if path not in self.files:
            raise NotFoundError(404, "not_found", f"no file {path!r} in /workspace")
        return self.files[path]

    async def interrupt(self, execution_id: str) -> None:
        self.calls.append(("interrupt", execution_id))

    async def snapshot(self) -> SnapshotInfo:
        return SnapshotInfo(
            id="s1", session_id="x", created_at=NOW, size_bytes=10, duration=0.1,
            saved=["x"], skipped={"gen": "cannot pickle generator"},
        )  # fmt: skip


# -- schemas ---------------------------------------------------------------------------


def test_openai_and_anthropic_shapes_come_from_the_same_models() -> None:
    openai = openai_tools()
    anthropic = anthropic_tools()
    names = ["execute_python", "upload_file", "download_file", "interrupt", "snapshot"]
    assert [t["function"]["name"] for t in openai] == names
    assert [t["name"] for t in anthropic] == names
    for o, a in zip(openai, anthropic, strict=True):
        assert o["type"] == "function"
        assert set(o["function"]) == {"name", "description", "parameters"}
        assert set(a) == {"name", "description", "input_schema"}
        assert o["function"]["parameters"] == a["input_schema"] == TOOLS[a["name"]].json_schema()
        assert a["input_schema"]["type"] == "object"
        assert a["input_schema"]["additionalProperties"] is False
        assert "title" not in json.dumps(a["input_schema"])
        assert "anyOf" not in a["input_schema"]["properties"].get("timeout", {})


def test_schema_required_and_optional_fields() -> None:
    schema = TOOLS["execute_python"].json_schema()
    assert schema["required"] == ["code"]
    assert schema["properties"]["timeout"]["type"] == "number"
    assert "default" not in schema["properties"]["timeout"]
    upload = TOOLS["upload_file"].json_schema()
    assert upload["required"] == ["path"]
    assert {"text", "content_base64"} <= set(upload["properties"])
    assert TOOLS["interrupt"].json_schema()["properties"] == {}


# -- pure shaping ----------------------------------------------------------------------


def test_truncate_keeps_head_and_tail_within_budget() -> None:
    text = "H" * 5000 + "M" * 5000 + "T" * 5000
    short = truncate(text, 300)
    assert len(short) <= 300
    assert short.startswith("H") and short.endswith("T")
    marker = short.split("\n")[1]
    cut = int(marker.removeprefix("… [truncated ").removesuffix(" characters]"))
    assert cut == len(text) - (len(short) - len(marker) - 2)
    assert truncate("small", 300) == "small"


def test_strip_ansi() -> None:
    coloured = "\x1b[0;31mZeroDivisionError\x1b[0m: \x1b[1mdivision\x1b]8;;http://x\x07 by zero"
    assert strip_ansi(coloured) == "ZeroDivisionError: division by zero"


def test_summarize_error_keeps_the_tail_without_colours() -> None:
    traceback = [f"\x1b[32mframe {i}\x1b[0m\n  line" for i in range(30)]
    error = CellError(name="ValueError", value="bad \x1b[1mthing\x1b[0m", traceback=traceback)
    summary = summarize_error(error, traceback_lines=4)
    lines = summary.splitlines()
    assert lines[0] == "ValueError: bad thing"
    assert lines[1] == "… 56 traceback lines omitted …"
    assert lines[2:] == ["frame 28", "  line", "frame 29", "  line"]
    assert "\x1b" not in summary


def test_render_execution_sections_images_and_error() -> None:
    err = CellError(name="KeyError", value="'a'", traceback=["\x1b[31mKeyError\x1b[0m: 'a'"])
    ex = execution(
        out("printed\n"),
        out("warned\n", "stderr"),
        DisplayEvent(execution_id="e1", data={"image/png": PNG, "text/plain": "<Figure>"}),
        DisplayEvent(execution_id="e1", data={"text/plain": "a table"}),
        ResultEvent(execution_id="e1", data={"text/plain": "42"}),
        ErrorEvent(execution_id="e1", error=err),
        status=ExecutionStatus.FAILED,
        error=err,
    )
    result = render_execution(ex)
    assert result.is_error
    assert "[stdout]\nprinted" in result.text
    assert "[stderr]\nwarned" in result.text
    assert "[display]\na table" in result.text and "<Figure>" not in result.text
    assert "[result]\n42" in result.text
    assert "[error]\nKeyError: 'a'" in result.text
    assert [(a.mime_type, a.data_base64) for a in result.images] == [("image/png", PNG)]


def test_render_caps_images_and_text() -> None:
    displays = [DisplayEvent(execution_id="e1", data={"image/png": PNG}) for _ in range(6)]
    result = render_execution(execution(out("x" * 50_000), *displays), max_chars=1000, max_images=2)
    assert len(result.images) == 2
    assert "2 attached, 4 more omitted" in result.text
    assert len(result.text) <= 1000
    assert "… [truncated" in result.text
    assert not result.is_error


def test_render_timeout_says_what_happened() -> None:
    ex = execution(status=ExecutionStatus.TIMED_OUT, reason="timed out after 1 s", state_lost=True)
    result = render_execution(ex)
    assert result.is_error
    assert "[status] timed_out: timed out after 1 s" in result.text
    assert "variables and imports are gone" in result.text


def test_provider_renderings() -> None:
    result = render_execution(
        execution(out("hi\n"), DisplayEvent(execution_id="e1", data={"image/png": PNG}))
    )
    message = result.to_openai_message("call_1")
    assert message["role"] == "tool" and message["tool_call_id"] == "call_1"
    assert "hi" in message["content"] and "1 image(s) follow" in message["content"]
    images = result.openai_image_message()
    assert images is not None
    assert images["content"][1]["image_url"]["url"] == f"data:image/png;base64,{PNG}"
    block = result.to_anthropic_block("toolu_1")
    assert block["type"] == "tool_result" and block["tool_use_id"] == "toolu_1"
    assert block["is_error"] is False
    assert block["content"][0]["type"] == "text"
    assert block["content"][1] == {
        "type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG},
    }  # fmt: skip


# -- argument validation and dispatch ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "arguments", "hint"),
    [
        ("nope", {}, "unknown tool 'nope'; the tools are: execute_python"),
        ("execute_python", "{not json", "not valid JSON"),
        ("execute_python", "[1]", "must be a JSON object"),
        ("execute_python", {}, "code: Field required"),
        ("execute_python", {"code": "1", "timeout": -1}, "timeout: Input should be greater than 0"),
        ("execute_python", {"code": "1", "cwd": "/"}, "cwd: Extra inputs are not permitted"),
        ("upload_file", {"path": "a"}, "give exactly one of `text` or `content_base64`"),
        ("upload_file", {"path": "a", "text": "x", "content_base64": "eA=="}, "exactly one"),
        ("upload_file", {"path": "a", "content_base64": "!!"}, "not valid base64"),
        ("download_file", {"path": "missing.txt"}, "no file 'missing.txt'"),
    ],
)
async def test_bad_calls_come_back_as_errors_the_model_can_fix(
    name: str, arguments: Any, hint: str
) -> None:
    result = await ToolRunner(FakeSession()).run(name, arguments)
    assert result.is_error
    assert hint in result.text


async def test_execute_passes_code_and_timeout_and_json_string_arguments() -> None:
    session = FakeSession()
    result = await ToolRunner(session).run(
        "execute_python", json.dumps({"code": "print('hi')", "timeout": 5})
    )
    assert session.calls == [("run", ("print('hi')", 5.0))]
    assert result.text == "[stdout]\nhi\n" and not result.is_error


async def test_files_round_trip() -> None:
    session = FakeSession()
    runner = ToolRunner(session)
    wrote = await runner.run("upload_file", {"path": "a.txt", "text": "héllo"})
    assert wrote.text == "wrote 6 bytes to a.txt"
    read = await runner.run("download_file", {"path": "a.txt"})
    assert read.text == "a.txt (6 bytes):\nhéllo"
    await runner.run("upload_file", {"path": "p.png", "content_base64": PNG})
    image = await runner.run("download_file", {"path": "p.png"})
    assert image.images[0].mime_type == "image/png"
    assert base64.b64decode(image.images[0].data_base64) == base64.b64decode(PNG)
    await runner.run("upload_file", {"path": "b.bin", "content_base64": "//79"})
    binary = await runner.run("download_file", {"path": "b.bin"})
    assert "binary, 3 bytes; base64:\n//79" in binary.text


async def test_interrupt_and_snapshot() -> None:
    session = FakeSession()
    runner = ToolRunner(session)
    idle = await runner.run("interrupt", {})
    assert "nothing is running" in idle.text and not idle.is_error
    snap = await runner.run("snapshot", None)
    assert snap.text == "snapshot s1: saved x (10 bytes)\nnot saved: gen (cannot pickle generator)"


# A pandas KeyError as the kernel formats it (paths shortened), in IPython's two modes.
_SITE = "/opt/kernel/lib/python3.11/site-packages/pandas"
PLAIN_KEYERROR = f"""Traceback (most recent call last):
  File {_SITE}/core/indexes/base.py:3816 in get_loc
    return self._engine.get_loc(casted_key)
  File pandas/_libs/index.pyx:172 in pandas._libs.index.IndexEngine.get_loc
  File pandas/_libs/hashtable_class_helper.pxi:7734 in pandas._libs.hashtable.PyObjectHashTable.get_item
KeyError: 'missing'

The above exception was the direct cause of the following exception:
Traceback (most recent call last):
  Cell In[1], line 3
    f(df)
  Cell In[1], line 2 in f
    return d['missing']
  File {_SITE}/core/frame.py:4330 in __getitem__
    indexer = self.columns.get_loc(key)
  File {_SITE}/core/indexes/base.py:3823 in get_loc
    raise KeyError(key) from err
KeyError: 'missing'"""

CONTEXT_KEYERROR = f"""\x1b[31m---------------------------------------------------------------------------\x1b[39m
\x1b[31mKeyError\x1b[39m                                  Traceback (most recent call last)
\x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[1]\x1b[39m\x1b[32m, line 3\x1b[39m
\x1b[32m      1\x1b[39m \x1b[38;5;28;01mdef\x1b[39;00m\x1b[38;5;250m \x1b[39m\x1b[34mf\x1b[39m(d):
\x1b[32m      2\x1b[39m     \x1b[38;5;28;01mreturn\x1b[39;00m d[\x1b[33m'missing'\x1b[39m]
\x1b[32m----> 3\x1b[39m f(df)

Cell In[1], line 2, in f(d)
      1 def f(d):
----> 2     return d['missing']

File {_SITE}/core/frame.py:4330, in DataFrame.__getitem__(self, key)
   4328             if self.columns.nlevels > 1:
   4329                 return self._getitem_multilevel(key)
-> 4330             indexer = self.columns.get_loc(key)
   4331             if is_integer(indexer):

File {_SITE}/core/indexes/base.py:3823, in Index.get_loc(self, key)
   3822         raise InvalidIndexError(key) from err
-> 3823     raise KeyError(key) from err
   3824 except TypeError:

KeyError: 'missing'"""


def test_trim_traceback_plain_mode_keeps_user_frames_and_exceptions() -> None:
    trimmed = trim_traceback(PLAIN_KEYERROR.splitlines())
    assert trimmed == [
        "Traceback (most recent call last):",
        "… 2 library frames …",
        "  File pandas/_libs/hashtable_class_helper.pxi:7734 in pandas._libs.hashtable.PyObjectHashTable.get_item",
        "KeyError: 'missing'",
        "",
        "The above exception was the direct cause of the following exception:",
        "Traceback (most recent call last):",
        "  Cell In[1], line 3",
        "    f(df)",
        "  Cell In[1], line 2 in f",
        "    return d['missing']",
        "… 1 library frame …",
        f"  File {_SITE}/core/indexes/base.py:3823 in get_loc",
        "    raise KeyError(key) from err",
        "KeyError: 'missing'",
    ]


def test_trim_traceback_context_mode_keeps_only_the_current_lines() -> None:
    trimmed = trim_traceback(strip_ansi(CONTEXT_KEYERROR).splitlines())
    assert trimmed[2:] == [
        "Cell In[1], line 3",
        "----> 3 f(df)",
        "Cell In[1], line 2, in f(d)",
        "----> 2     return d['missing']",
        "… 1 library frame …",
        f"File {_SITE}/core/indexes/base.py:3823, in Index.get_loc(self, key)",
        "-> 3823     raise KeyError(key) from err",
        "KeyError: 'missing'",
    ]
    assert trim_traceback(["no frames here", "ValueError: x"]) == [
        "no frames here",
        "ValueError: x",
    ]


def test_summarize_error_of_a_library_error_names_the_users_line() -> None:
    error = CellError(name="KeyError", value="'missing'", traceback=[CONTEXT_KEYERROR])
    summary = summarize_error(error)
    assert summary.splitlines()[0] == "KeyError: 'missing'"
    assert "Cell In[1], line 3" in summary and "----> 2     return d['missing']" in summary
    assert "frame.py" not in summary and "… 1 library frame …" in summary
    assert (
        summary.endswith("KeyError: 'missing'") and "\x1b" not in summary and "-----" not in summary
    )
    # Short of room, the first user frame still comes ahead of the end.
    tight = summarize_error(error, traceback_lines=6).splitlines()
    assert tight[1].startswith("… ") and tight[2:4] == ["Cell In[1], line 3", "----> 3 f(df)"]
    assert tight[-1] == "KeyError: 'missing'" and len(tight) == 8
