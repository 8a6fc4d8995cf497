"""The pure Jupyter side: kernel ids, both framings (held against jupyter_server's own
v1 code), and kernelhub events turned into the messages a Jupyter client expects."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from kernelhub.errors import FrameError
from kernelhub.jupyter import messages
from kernelhub.jupyter.messages import Origin, Translator


def test_kernel_ids_are_uuids_stable_per_session_and_distinct() -> None:
    a, b = messages.kernel_id("0123456789abcdef"), messages.kernel_id("0123456789abcdee")
    assert str(uuid.UUID(a)) == a and a != b
    assert messages.kernel_id("0123456789abcdef") == a


def sample() -> dict[str, Any]:
    msg = messages.message("shell", "execute_request", {"code": "1+1"}, {}, "s1")
    msg["buffers"] = [b"\x00\x01binary"]
    return msg


def test_v1_frames_are_jupyter_servers_own() -> None:
    base = pytest.importorskip("jupyter_server.services.kernels.connection.base")
    msg = sample()
    channel, parts = base.deserialize_msg_from_ws_v1(messages.to_v1_frame(msg))
    assert channel == "shell"
    assert [json.loads(p) for p in parts[:4]] == [
        msg["header"], msg["parent_header"], msg["metadata"], msg["content"]
    ]  # fmt: skip
    assert parts[4:] == [b"\x00\x01binary"]
    theirs = base.serialize_msg_to_ws_v1(
        [json.dumps(msg[k]).encode() for k in ("header", "parent_header", "metadata", "content")],
        "shell",
    )
    back = messages.from_v1_frame(theirs)
    assert back["content"] == {"code": "1+1"} and back["channel"] == "shell"


def test_json_frames_round_trip_and_bad_frames_are_refused() -> None:
    msg = sample()
    msg["buffers"] = []
    assert messages.from_json_frame(messages.to_json_frame(msg)) == msg
    for bad in ("nope", "[]", '{"channel": "shell", "content": {}}', '{"channel": "x"}'):
        with pytest.raises(FrameError):
            messages.from_json_frame(bad)
    for raw in (b"", b"\x05" + b"\x00" * 7, (7).to_bytes(8, "little") + b"\xff" * 56):
        with pytest.raises(FrameError):
            messages.from_v1_frame(raw)


def test_is_complete_compiles_without_running() -> None:
    assert messages.is_complete_content("x = 1")["status"] == "complete"
    assert messages.is_complete_content("for i in x:") == {"status": "incomplete", "indent": "    "}
    assert messages.is_complete_content("x = )")["status"] == "invalid"


def events(eid: str, *rest: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"execution_id": eid, **e} for e in rest]


def final(status: str, count: int | None, **extra: Any) -> dict[str, Any]:
    record = {"status": status, "execution_count": count, "started_at": "t", **extra}
    return {"type": "final", "record": record}


def run(t: Translator, evs: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for e in evs:
        for m in t.translate(e):
            out.append((m["channel"], m["header"]["msg_type"], m))
    return out


def test_a_cell_it_sent_answers_its_request_in_jupyters_order() -> None:
    t = Translator()
    request = messages.header("execute_request", "client")
    t.sent("e1", Origin(parent=request), "print(1)\n1")
    out = run(
        t,
        events(
            "e1",
            {"type": "status", "status": "queued"},
            {"type": "status", "status": "running"},
            {"type": "stream", "name": "stdout", "text": "1\n"},
            {"type": "display", "data": {"image/png": "iVBO"}, "display_id": "d"},
            {"type": "result", "data": {"text/plain": "1"}, "execution_count": 3},
            final("completed", 3),
        ),
    )
    assert [(c, k) for c, k, _ in out] == [
        ("iopub", "status"), ("iopub", "execute_input"), ("iopub", "stream"),
        ("iopub", "display_data"), ("iopub", "execute_result"), ("shell", "execute_reply"),
        ("iopub", "status"),
    ]  # fmt: skip
    assert all(m["parent_header"] is request for _, _, m in out)
    assert out[1][2]["content"]["code"] == "print(1)\n1"
    assert out[3][2]["content"]["transient"] == {"display_id": "d"}
    assert out[5][2]["content"] == {
        "status": "ok",
        "execution_count": 3,
        "user_expressions": {},
        "payload": [],
    }
    assert [m["content"]["execution_state"] for c, k, m in out if k == "status"] == ["busy", "idle"]


def test_failures_interrupts_and_resumes_after_input() -> None:
    t = Translator()
    t.sent("e2", Origin(parent=messages.header("execute_request", "c")), "input()")
    out = run(
        t,
        events(
            "e2",
            {"type": "status", "status": "running"},
            {"type": "input_request", "prompt": "who? ", "password": False},
            {"type": "status", "status": "awaiting_input"},
            {"type": "status", "status": "running"},  # answered: not a second execute_input
            {"type": "error", "error": {"name": "ValueError", "value": "v", "traceback": ["tb"]}},
            final("failed", 1, error={"name": "ValueError", "value": "v", "traceback": ["tb"]}),
        ),
    )
    kinds = [k for _, k, _ in out]
    assert kinds.count("execute_input") == 1
    (asked,) = [m for c, k, m in out if k == "input_request"]
    assert asked["channel"] == "stdin" and asked["content"]["prompt"] == "who? "
    (done,) = [m for c, k, m in out if k == "execute_reply"]
    assert done["content"]["status"] == "error" and done["content"]["ename"] == "ValueError"
    t.sent("e3", Origin(parent=messages.header("execute_request", "c")), "sleep")
    (reply,) = [
        m for c, k, m in run(t, events("e3", final("interrupted", None))) if k == "execute_reply"
    ]
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    t.sent("e4", Origin(parent=messages.header("execute_request", "c")), "x")
    cancelled = {"status": "cancelled", "execution_count": None, "started_at": None}
    (reply,) = [
        m
        for c, k, m in run(t, events("e4", {"type": "final", "record": cancelled}))
        if k == "execute_reply"
    ]
    assert reply["content"]["status"] == "aborted"


def test_someone_elses_cell_is_watched_on_iopub_but_gets_no_reply_or_prompt() -> None:
    t = Translator()
    out = run(
        t,
        events(
            "agent-exec",
            {"type": "status", "status": "running"},
            {"type": "input_request", "prompt": "?"},
            {"type": "stream", "name": "stdout", "text": "hi\n"},
            final("completed", 7),
        ),
    )
    assert [(c, k) for c, k, _ in out] == [
        ("iopub", "status"), ("iopub", "execute_input"), ("iopub", "stream"), ("iopub", "status")
    ]  # fmt: skip
    assert all(m["parent_header"]["msg_id"] == "agent-exec" for _, _, m in out)
    assert t.execution_count == 7
