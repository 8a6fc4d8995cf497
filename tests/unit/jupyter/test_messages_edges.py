"""The Jupyter message edges tests/unit/jupyter/test_messages.py leaves out
(kernelhub/jupyter/messages.py): timestamps Jupyter Server parses, binary frames with
buffers and broken offsets, and the events that become display updates, clear_output
and stderr notices."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from kernelhub.errors import FrameError
from kernelhub.jupyter import messages
from kernelhub.jupyter.messages import Origin, Translator


def test_jupyter_time_is_utc_with_microseconds_and_z() -> None:
    when = datetime(2025, 3, 4, 5, 6, 7, 890, tzinfo=timezone(timedelta(hours=2)))
    text = messages.jupyter_time(when)
    assert text == "2025-03-04T03:06:07.000890Z"
    assert datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").hour == 3
    assert messages.now_iso().endswith("Z") and "+00:00" not in messages.now_iso()


def _msg(**extra: Any) -> dict[str, Any]:
    head = messages.header("execute_request", "s", msg_id="m1")
    return {
        "channel": "shell", "header": head, "parent_header": {}, "metadata": {},
        "content": {"code": "1"}, **extra,
    }  # fmt: skip


def test_binary_frames_carry_buffers_and_drop_non_bytes() -> None:
    msg = _msg(buffers=[b"\x00one", bytearray(b"two"), "not bytes", b""])
    back = messages.from_v1_frame(messages.to_v1_frame(msg))
    assert back["buffers"] == [b"\x00one", b"two"]
    assert back["header"]["msg_id"] == "m1" and back["content"] == {"code": "1"}


def _offsets(frame: bytes) -> list[int]:
    count = int.from_bytes(frame[:8], "little")
    return [int.from_bytes(frame[8 * (i + 1) : 8 * (i + 2)], "little") for i in range(count)]


def _with_offsets(frame: bytes, offsets: list[int]) -> bytes:
    head = len(offsets).to_bytes(8, "little") + b"".join(o.to_bytes(8, "little") for o in offsets)
    return head + frame[8 * (len(offsets) + 1) :]


def test_binary_frames_with_broken_offsets_or_parts_are_refused() -> None:
    good = messages.to_v1_frame(_msg())
    offsets = _offsets(good)
    swapped = [*offsets[:2], offsets[3], offsets[2], *offsets[4:]]
    past_end = [*offsets[:-1], len(good) + 100]
    with pytest.raises(FrameError, match="out of order or past its end"):
        messages.from_v1_frame(_with_offsets(good, swapped))
    with pytest.raises(FrameError, match="out of order or past its end"):
        messages.from_v1_frame(_with_offsets(good, past_end))
    broken = good.replace(b'{"code": "1"}', b'{"code": "1"')  # content no longer JSON
    with pytest.raises(FrameError, match="not JSON"):
        messages.from_v1_frame(_with_offsets(broken, [*offsets[:-1], offsets[-1] - 1]))
    with pytest.raises(FrameError, match="shorter than its offset count"):
        messages.from_v1_frame(b"\x06\x00")


@pytest.mark.parametrize(
    ("frame", "said"),
    [
        ({"channel": "shell", "header": {"msg_type": 1}, "content": {}}, "no header.msg_type"),
        ({"channel": "shell", "header": {"msg_type": "x"}, "content": []}, "not an object"),
        ({"channel": "hb", "header": {"msg_type": "x"}, "content": {}}, "'hb' is not one of"),
    ],
)
def test_json_frames_name_what_is_wrong(frame: dict[str, Any], said: str) -> None:
    with pytest.raises(FrameError, match=said):
        messages.from_json_frame(json.dumps(frame))


def _types(msgs: list[dict[str, Any]]) -> list[str]:
    return [m["header"]["msg_type"] for m in msgs]


def test_displays_updates_clears_and_notices() -> None:
    t = Translator()
    shown = t.translate({"type": "display", "execution_id": "e", "data": {"text/plain": "1"}})
    updated = t.translate(
        {"type": "display", "execution_id": "e", "display_id": "d1", "update": True, "data": {}}
    )
    assert _types(shown) == ["display_data"] and shown[0]["content"]["transient"] == {}
    assert _types(updated) == ["update_display_data"]
    assert updated[0]["content"]["transient"] == {"display_id": "d1"}
    cleared = t.translate({"type": "clear_output", "execution_id": "e", "wait": 1})
    assert _types(cleared) == ["clear_output"] and cleared[0]["content"] == {"wait": True}
    notice = t.translate({"type": "notice", "execution_id": "e", "message": "paused"})
    cut = t.translate({"type": "truncated", "execution_id": "e", "limit_bytes": 4096})
    assert [m["content"] for m in notice + cut] == [
        {"name": "stderr", "text": "paused\n"},
        {"name": "stderr", "text": "[kernelhub: output truncated at 4096 bytes]\n"},
    ]
    # someone else's cell: the synthetic parent is an execute_request named by its id
    assert shown[0]["parent_header"]["msg_id"] == "e"
    assert shown[0]["parent_header"]["msg_type"] == "execute_request"


def test_a_silent_request_sees_nothing_but_its_end() -> None:
    t = Translator()
    parent = messages.header("execute_request", "client", msg_id="req")
    t.sent("e", Origin(parent, silent=True), "x = 1")
    for event in (
        {"type": "status", "status": "running", "execution_id": "e"},
        {"type": "stream", "name": "stdout", "text": "hi", "execution_id": "e"},
        {"type": "display", "execution_id": "e", "data": {}},
    ):
        assert t.translate(event) == []
    assert "e" not in t.begun
