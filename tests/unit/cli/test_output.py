"""The CLI's words: tables, --json, one-line reasons, errors in flags and commands."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime

import httpx
import pytest

from kernelhub.cli.output import (
    Console,
    describe_error,
    one_line,
    session_detail,
    sessions_table,
    table,
)
from kernelhub.client.errors import GatewayUnreachableError, ProtocolError, api_error
from kernelhub.errors import KernelhubError
from kernelhub.models import StreamEvent
from kernelhub.wire import SessionInfo, SessionState

TRACEBACK = (
    "Traceback (most recent call last):\n"
    + "".join(f'  File "/opt/kernel/lib/x.py", line {n}, in f\n    g()\n' for n in range(12))
    + "RuntimeError: kernel died: out of memory (limit 512 MiB)"
)


def info(
    sid: str, state: SessionState = SessionState.READY, reason: str | None = None
) -> SessionInfo:
    return SessionInfo(
        id=sid,
        owner="alice",
        state=state,
        backend="docker",
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        limits={"memory_bytes": 536870912, "cpus": 1.0},
        metadata={"job": "a"},
        reason=reason,
    )


def test_empty_session_list_says_so() -> None:
    assert sessions_table([]) == "no sessions"


def test_session_table_has_a_header_aligned_columns_and_one_line_per_session() -> None:
    out = sessions_table([info("a" * 16), info("b", SessionState.DEAD, TRACEBACK)])
    lines = out.splitlines()
    assert len(lines) == 3
    assert lines[0].split() == ["ID", "STATE", "BACKEND", "CREATED", "REASON"]
    assert lines[1].startswith("a" * 16 + "  ready ")
    assert lines[2].startswith("b" + " " * 17 + "dead ")
    assert lines[0].index("STATE") == lines[1].index("ready") == lines[2].index("dead")
    assert "2026-01-02 03:04:05" in lines[2]
    # The reason is the exception line, not "Traceback (most recent call last):".
    assert "RuntimeError: kernel died" in lines[2] and "Traceback" not in out
    assert len(lines[2]) < 130


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (None, ""),
        ("", ""),
        ("idle for 600 s", "idle for 600 s"),
        ("first line\nsecond line", "first line …"),
        ("x" * 100, "x" * 59 + "…"),
        ("\n\n  padded  \n", "padded"),
        (TRACEBACK, "RuntimeError: kernel died: out of memory (limit 512 MiB) …"),
    ],
)
def test_one_line_reasons(reason: str | None, expected: str) -> None:
    assert one_line(reason) == expected
    assert "\n" not in one_line(reason) and len(one_line(reason)) <= 60


def test_show_has_every_field_and_the_whole_reason() -> None:
    out = session_detail(info("abc", SessionState.DEAD, TRACEBACK))
    assert "id:            abc" in out and "state:         dead" in out
    assert "memory_bytes=536870912" in out and "job=a" in out
    assert all(line in out for line in TRACEBACK.splitlines())


def test_json_is_the_gateways_shape() -> None:
    from kernelhub.cli.output import to_json

    rows = json.loads(to_json([info("a"), info("b")]))
    assert [r["id"] for r in rows] == ["a", "b"]
    assert rows[0]["state"] == "ready" and rows[0]["created_at"].startswith("2026-01-02T03:04:05")
    assert json.loads(to_json([])) == []
    assert json.loads(to_json(info("a")))["limits"]["cpus"] == 1.0


def test_table_does_not_pad_the_last_column() -> None:
    assert table(("A", "B"), [("long value", "x"), ("y", "z")]).splitlines() == [
        "A           B",
        "long value  x",
        "y           z",
    ]


def err(status: int, kind: str, message: str) -> KernelhubError:
    return api_error(status, kind, message)


URL = "http://127.0.0.1:8765"


@pytest.mark.parametrize(
    ("exc", "wanted"),
    [
        (
            err(401, "unauthorized", "unknown or revoked token"),
            ["--token", "KERNELHUB_TOKEN", "kernelhub token create"],
        ),
        (err(403, "forbidden", "admin only"), ["admin token", "--token"]),
        (err(404, "not_found", "no session 'x'"), ["no session 'x'", "kernelhub sessions ls"]),
        (err(410, "session_ended", "session x has ended"), ["kernelhub sessions new"]),
        (err(409, "conflict", "session x is busy"), ["kernelhub sessions show"]),
        (err(500, "internal", "boom"), ["boom", "kernelhub serve"]),
        (ProtocolError("unexpected frame"), ["kernelhub --version"]),
    ],
)
def test_errors_name_flags_and_commands_not_sdk_arguments(
    exc: KernelhubError, wanted: list[str]
) -> None:
    said = describe_error(exc, URL)
    assert all(w in said for w in wanted), said
    for sdk_word in ("base_url=", "Hub(", "hub.", "session.info()", "get_execution()", "timeout="):
        assert sdk_word not in said


def test_unreachable_gateway_names_the_url_and_the_flag() -> None:
    try:
        raise GatewayUnreachableError("GET ... check base_url= and ...") from httpx.ConnectError(
            "refused"
        )
    except GatewayUnreachableError as exc:
        said = describe_error(exc, "http://10.0.0.9:1")
    assert "http://10.0.0.9:1" in said and "--url" in said and "KERNELHUB_URL" in said
    assert "kernelhub serve" in said and "refused" in said and "base_url" not in said


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


EVIL = "ok \x1b[31mred\x1b[0m\x1b]52;c;cHduZWQ=\x07\x1b[2J"


def test_sandbox_output_to_a_terminal_keeps_colours_only() -> None:
    out, err_ = Tty(), Tty()
    console = Console(out, err_)
    console.event(StreamEvent(seq=1, execution_id="e", name="stdout", text=EVIL[:12]))
    console.event(StreamEvent(seq=2, execution_id="e", name="stdout", text=EVIL[12:]))
    console.sandbox(EVIL, err=True)
    assert out.getvalue() == err_.getvalue() == "ok \x1b[31mred\x1b[0m"


def test_raw_and_pipes_get_the_bytes_as_produced() -> None:
    raw, pipe = Tty(), io.StringIO()
    Console(raw, raw, raw=True).sandbox(EVIL)
    Console(pipe, pipe).sandbox(EVIL)
    assert raw.getvalue() == pipe.getvalue() == EVIL


def test_the_gateways_sdk_advice_becomes_flags() -> None:
    from kernelhub.cli.output import in_cli_words
    from kernelhub.models import EndedBy, ExecutionRecord, ExecutionStatus, FinalEvent

    reason = "execution timed out after 2 s; pass timeout= or set KERNELHUB_LIMITS__CELL_TIMEOUT"
    assert in_cli_words(reason).endswith("pass --timeout or set KERNELHUB_LIMITS__CELL_TIMEOUT")
    out = io.StringIO()
    now = datetime.now(UTC)
    record = ExecutionRecord(
        execution_id="e",
        status=ExecutionStatus.TIMED_OUT,
        ended_by=EndedBy.INTERRUPT,
        reason=reason,
        queued_at=now,
        finished_at=now,
        duration=2.0,
    )
    Console(out, out).event(FinalEvent(seq=3, execution_id="e", record=record))
    assert "pass --timeout" in out.getvalue() and "timeout=" not in out.getvalue()
    said = describe_error(err(409, "conflict", "use hub.create_session()"), URL)
    assert "`kernelhub sessions new`" in said and "hub." not in said
