"""The output spool (``kernelhub_kernel/spool.py``) written to a real file: one user
cell's messages, bounded, what is dropped counted, other requests left out."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.unit.kernel_image.loader import load

spool = load("spool")


def msg(msg_type: str, parent: str, **content: Any) -> dict[str, Any]:
    """The parts of a Jupyter message the spool reads (it keeps the rest as given)."""
    return {
        "header": {"msg_type": msg_type},
        "parent_header": {"msg_id": parent},
        "content": content,
    }


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def cell(s: Any, parent: str, code: str, outputs: list[str]) -> None:
    s.record(msg("status", parent, execution_state="busy"))
    s.record(msg("execute_input", parent, code=code))
    for text in outputs:
        s.record(msg("stream", parent, name="stdout", text=text))
    s.record(msg("status", parent, execution_state="idle"))
    s.record(msg("execute_reply", parent, status="ok"))


def test_a_cell_is_spooled_in_order_with_its_busy_first(tmp_path: Path) -> None:
    path = tmp_path / spool.SPOOL_FILE
    s = spool.Spool(str(path), 1 << 20)
    cell(s, "c1", "print(1)", ["1\n", "2\n"])
    got = lines(path)
    assert got[0]["cell"] == "c1"
    import hashlib

    assert got[0]["code_sha256"] == hashlib.sha256(b"print(1)").hexdigest()
    kinds = [g["m"]["header"]["msg_type"] for g in got[1:]]
    assert kinds == ["status", "execute_input", "stream", "stream", "status", "execute_reply"]
    assert got[1]["m"]["content"]["execution_state"] == "busy"
    assert "t" in got[-1]
    assert not any("dropped_bytes" in g for g in got)
    assert (os.stat(path).st_mode & 0o777) == 0o600


def test_the_next_user_cell_empties_the_file_and_silent_requests_never_touch_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / spool.SPOOL_FILE
    s = spool.Spool(str(path), 1 << 20)
    cell(s, "c1", "a", ["first\n"])
    # A silent execute (no execute_input): its messages are not the spooled cell's.
    s.record(msg("status", "silent", execution_state="busy"))
    s.record(msg("stream", "silent", name="stdout", text="hidden\n"))
    s.record(msg("execute_reply", "silent", status="ok"))
    assert "hidden" not in path.read_text()
    cell(s, "c2", "b", ["second\n"])
    text = path.read_text()
    assert "first" not in text and "second" in text
    assert lines(path)[0]["cell"] == "c2"


def test_past_the_cap_only_bookkeeping_is_written_and_the_rest_is_counted(
    tmp_path: Path,
) -> None:
    path = tmp_path / spool.SPOOL_FILE
    s = spool.Spool(str(path), 1200)
    cell(s, "c1", "flood", [f"{i:04d}" + "x" * 100 + "\n" for i in range(20)])
    got = lines(path)
    kinds = [g["m"]["header"]["msg_type"] for g in got if "m" in g]
    assert kinds[-2:] == ["status", "execute_reply"]
    kept = kinds.count("stream")
    assert 0 < kept < 20
    (dropped,) = [g for g in got if "dropped_messages" in g]
    assert dropped["dropped_messages"] == 20 - kept
    assert dropped["dropped_bytes"] > 0
    # The count line comes just before the reply, so a reader meets it in time.
    assert got.index(dropped) == len(got) - 1 - 1


def test_messages_without_a_parent_or_malformed_are_ignored_not_raised(tmp_path: Path) -> None:
    path = tmp_path / spool.SPOOL_FILE
    s = spool.Spool(str(path), 1 << 20)
    s.record({"header": {"msg_type": "stream"}})
    s.record({"header": None, "parent_header": {"msg_id": 3}})
    assert not path.exists()
    s.record(msg("execute_input", "c1", code="x"))
    s.record({"header": {"msg_type": "stream"}, "parent_header": {"msg_id": "c1"}, "content": {}})
    assert len(lines(path)) == 3


def test_a_spool_whose_file_cannot_be_opened_counts_instead_of_raising(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = tmp_path / spool.SPOOL_FILE
    link.symlink_to(target)  # O_NOFOLLOW: never written through a link
    s = spool.Spool(str(link), 1 << 20)
    cell(s, "c1", "x", ["out\n"])
    assert target.read_text() == ""
    assert s._dropped_messages >= 1


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, spool.DEFAULT_SPOOL_BYTES),
        ({spool.SPOOL_BYTES_ENV: "1234"}, 1234),
        ({spool.SPOOL_BYTES_ENV: "lots"}, spool.DEFAULT_SPOOL_BYTES),
        ({spool.SPOOL_BYTES_ENV: "-5"}, 0),
    ],
)
def test_spool_from_reads_the_state_directory_and_cap(
    tmp_path: Path, env: dict[str, str], expected: int
) -> None:
    s = spool.spool_from({"KERNELHUB_SNAPSHOTS": str(tmp_path), **env})
    assert s is not None
    assert s.path == str(tmp_path / spool.SPOOL_FILE)
    assert s.max_bytes == expected


def test_no_state_directory_means_no_spool(tmp_path: Path) -> None:
    assert spool.spool_from({"KERNELHUB_SNAPSHOTS": str(tmp_path / "absent")}) is None


def test_install_spools_what_a_real_session_sends_as_it_packed_it(tmp_path: Path) -> None:
    from jupyter_client.session import Session

    class SpooledSession(Session):
        pass

    class Stream:
        def __init__(self) -> None:
            self.sent: list[list[bytes]] = []

        def send_multipart(self, frames: list[bytes], *args: Any, **kwargs: Any) -> None:
            self.sent.append(frames)

    path = tmp_path / spool.SPOOL_FILE
    s = spool.Spool(str(path), 1 << 20)
    spool.install(SpooledSession, s)
    session, stream = SpooledSession(key=b"k"), Stream()
    request = {"msg_id": "c9", "msg_type": "execute_request"}
    session.send(stream, "status", {"execution_state": "busy"}, parent=request)
    session.send(stream, "execute_input", {"code": "1", "n": "\u00e9\n"}, parent=request)
    session.send(stream, "execute_reply", {"status": "ok"}, parent=request)
    got = lines(path)
    assert got[0]["cell"] == "c9"
    # Each spooled message is the one on the wire: the same four JSON parts, the header's
    # datetime as the Session wrote it.
    on_wire = [[json.loads(f) for f in frames[-4:]] for frames in stream.sent]
    spooled = [
        [g["m"][k] for k in ("header", "parent_header", "metadata", "content")] for g in got[1:]
    ]
    assert spooled == on_wire
    assert got[2]["m"]["content"]["n"] == "\u00e9\n"
    assert isinstance(got[-1]["t"], float) and "t" not in got[1]

    class Broken:
        def record_packed(self, msg: Any, frames: Any) -> None:
            raise RuntimeError("disk on fire")

    class Other:
        def serialize(self, msg: Any, ident: Any = None) -> Any:
            return [b"frames"]

    spool.install(Other, Broken())
    assert Other().serialize({"header": {}}) == [b"frames"]


def test_unpacked_frames_fall_back_to_encoding_the_message(tmp_path: Path) -> None:
    path = tmp_path / spool.SPOOL_FILE
    s = spool.Spool(str(path), 1 << 20)
    s.record_packed(msg("execute_input", "c1", code="x"), [b"<DELIM>", b"sig"])
    s.record_packed(msg("stream", "c1", name="stdout", text="hi\n"), [b"not", b"json", b"x", b"y"])
    got = lines(path)
    assert got[0]["cell"] == "c1"
    assert got[2]["m"]["content"]["text"] == "hi\n"


def test_once_full_a_flood_is_counted_by_its_text_without_being_encoded(tmp_path: Path) -> None:
    path = tmp_path / spool.SPOOL_FILE
    s = spool.Spool(str(path), 100)  # the cell's own header line already passes it
    texts = ["a" * 10, "b" * 2000, "c"]
    cell(s, "c1", "flood", texts)
    got = lines(path)
    assert [g["m"]["header"]["msg_type"] for g in got if "m" in g] == [
        "status",
        "execute_input",
        "status",
        "execute_reply",
    ]
    (dropped,) = [g for g in got if "dropped_messages" in g]
    assert dropped == {"dropped_bytes": sum(map(len, texts)), "dropped_messages": len(texts)}
