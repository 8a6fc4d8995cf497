"""Our Jupyter message codec, tested with data: jupyter_client's Session is the oracle for
what a real kernel puts on the wire, and every hostile variant of it is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jupyter_client.session import Session

from kernelhub.errors import KernelError, KernelMessageError
from kernelhub.kernel.codec import (
    DELIMITER,
    MAX_BUFFERS,
    MAX_IDENTITIES,
    Codec,
    claimed_parent,
    split_identities,
    unpack,
)

KEY = b"k" * 32
LIMIT = 1 << 20


def kernel_frames(
    content: dict[str, Any] | None = None,
    *,
    msg_type: str = "execute_reply",
    key: bytes = KEY,
    ident: list[bytes] | None = None,
    buffers: list[bytes] | None = None,
) -> tuple[dict[str, Any], list[bytes]]:
    """What ipykernel sends: a message and its frames, built by jupyter_client."""
    kernel = Session(key=key)
    parent = kernel.msg_header("execute_request")
    msg = kernel.msg(msg_type, content if content is not None else {"status": "ok"}, parent=parent)
    frames = kernel.serialize(msg, ident=ident)
    return msg, [*frames, *(buffers or [])]


def codec(**kwargs: Any) -> Codec:
    return Codec(KEY, max_message_bytes=LIMIT, **kwargs)


def test_a_kernel_message_decodes_to_what_the_collector_reads() -> None:
    msg, frames = kernel_frames({"status": "ok", "execution_count": 3})
    got = codec().decode(frames)
    assert got["content"] == {"status": "ok", "execution_count": 3}
    assert got["msg_type"] == "execute_reply" == got["header"]["msg_type"]
    assert got["msg_id"] == msg["header"]["msg_id"]
    assert got["parent_header"]["msg_id"] == msg["parent_header"]["msg_id"]
    assert got["metadata"] == {}
    assert got["buffers"] == []
    assert isinstance(got["header"]["date"], str)  # left as the kernel sent it


def test_identities_and_buffers_come_through_and_memoryviews_decode() -> None:
    _, frames = kernel_frames(ident=[b"topic"], buffers=[b"\x00\x01", b"abc"])
    ids, parts = split_identities(frames)
    assert ids == [b"topic"] and len(parts) == 7
    got = codec().decode([memoryview(f) for f in frames])
    assert [bytes(b) for b in got["buffers"]] == [b"\x00\x01", b"abc"]


def test_what_we_encode_a_kernel_decodes_and_verifies() -> None:
    ours = codec(session="s1")
    msg_id, frames = ours.encode(
        "execute_request", {"code": "1+1", "silent": False}, metadata={"m": 1}
    )
    assert frames[0] == DELIMITER
    decoded = Session(key=KEY).deserialize(frames[1:])
    assert decoded["msg_id"] == msg_id
    assert decoded["header"]["session"] == "s1" and decoded["header"]["version"] == "5.3"
    assert decoded["content"] == {"code": "1+1", "silent": False}
    assert decoded["metadata"] == {"m": 1}
    assert decoded["parent_header"] == {}
    _, routed = ours.encode("input_reply", {"value": "é"}, identities=[b"peer"])
    assert routed[:2] == [b"peer", DELIMITER]
    assert Session(key=KEY).deserialize(routed[2:])["content"] == {"value": "é"}


@pytest.mark.parametrize(
    ("session", "username"), [("s1", "kernelhub"), ('quo"te\\é\u2028', "ünï\tcode")]
)
def test_the_header_frame_is_the_json_of_the_header(session: str, username: str) -> None:
    # The header is rendered from a per-msg_type template, not json.dumps: byte for byte
    # what json.dumps of header() gives, whatever the session and user names hold.
    ours = codec(session=session, username=username)
    for msg_type in ("execute_request", "input_reply", "execute_request"):
        _, frames = ours.encode(msg_type, {})
        header = json.loads(frames[2])
        expected = ours.header(msg_type) | {"msg_id": header["msg_id"], "date": header["date"]}
        assert list(header) == list(expected) and header == expected
        assert frames[2] == json.dumps(expected, ensure_ascii=False).encode()
        assert Session(key=KEY).deserialize(frames[1:])["header"]["msg_type"] == msg_type


def test_our_own_messages_round_trip() -> None:
    _, frames = codec().encode("stream", {"name": "stdout", "text": "hi"}, parent={"msg_id": "p"})
    got = codec().decode(frames)
    assert got["content"]["text"] == "hi" and got["parent_header"] == {"msg_id": "p"}


def test_another_key_an_altered_frame_and_no_signature_are_refused() -> None:
    _, frames = kernel_frames(key=b"x" * 32)
    with pytest.raises(KernelMessageError, match="invalid signature"):
        codec().decode(frames)
    _, frames = kernel_frames({"status": "ok"})
    tampered = [*frames[:5], frames[5].replace(b"ok", b"no")]
    with pytest.raises(KernelMessageError, match="invalid signature"):
        codec().decode(tampered)
    with pytest.raises(KernelMessageError, match="unsigned"):
        codec().decode([frames[0], b"", *frames[2:]])


def test_a_replayed_message_is_refused_and_the_history_is_bounded() -> None:
    c = codec(history=2)
    first = kernel_frames()[1]
    c.decode(first)
    with pytest.raises(KernelMessageError, match="replayed"):
        c.decode(first)
    c.decode(kernel_frames()[1])
    c.decode(kernel_frames()[1])  # the first signature is forgotten now
    c.decode(first)


def test_a_forged_message_does_not_enter_the_history() -> None:
    c = codec()
    _, frames = kernel_frames()
    forged = [*frames[:5], b'{"status": "error"}']
    with pytest.raises(KernelMessageError, match="invalid signature"):
        c.decode(forged)
    c.decode(frames)  # the genuine one, same signature, is still accepted


def test_truncated_oversized_and_undelimited_messages_are_refused() -> None:
    _, frames = kernel_frames()
    with pytest.raises(KernelMessageError, match="truncated"):
        codec().decode(frames[:4])
    with pytest.raises(KernelMessageError, match="delimiter"):
        codec().decode(frames[1:])
    with pytest.raises(KernelMessageError, match="delimiter"):
        codec().decode([b"id"] * (MAX_IDENTITIES + 1) + frames)
    big = kernel_frames({"text": "x" * LIMIT})[1]
    with pytest.raises(KernelMessageError, match=f"over the {LIMIT}-byte limit"):
        codec().decode(big)
    many = kernel_frames(buffers=[b""] * (MAX_BUFFERS + 1))[1]
    with pytest.raises(KernelMessageError, match="buffers"):
        codec().decode(many)


def signed(c: Codec, header: bytes, content: bytes = b"{}") -> list[bytes]:
    parts = [header, b"{}", b"{}", content]
    return [DELIMITER, c.sign(parts), *parts]


@pytest.mark.parametrize(
    ("header", "content", "error"),
    [
        (b"not json", b"{}", "header is not JSON"),
        (b"[1, 2]", b"{}", "header is a list"),
        (b'{"msg_id": "a", "msg_type": "x", "version": "5.3"}', b"\xff", "content is not JSON"),
        (b'{"msg_id": "a", "msg_type": "x", "version": "5.3"}', b'"text"', "content is a str"),
        (b'{"msg_type": "x", "version": "5.3"}', b"{}", "without a msg_type and msg_id"),
        (b'{"msg_id": "a", "msg_type": 7, "version": "5.3"}', b"{}", "without a msg_type"),
        (b'{"msg_id": "a", "msg_type": "x", "version": "4.1"}', b"{}", "version '4.1'"),
        (b'{"msg_id": "a", "msg_type": "x"}', b"{}", "version None"),
    ],
)
def test_malformed_but_signed_messages_are_refused(
    header: bytes, content: bytes, error: str
) -> None:
    c = codec()
    with pytest.raises(KernelMessageError, match=error):
        c.decode(signed(c, header, content))


def test_the_error_is_a_kernel_error() -> None:
    assert issubclass(KernelMessageError, KernelError)


def test_an_empty_key_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        Codec(b"", max_message_bytes=LIMIT)


def test_claimed_parent_is_a_hint_from_any_frames() -> None:
    msg, frames = kernel_frames(ident=[b"t"])
    assert claimed_parent(frames)["msg_id"] == msg["parent_header"]["msg_id"]
    assert claimed_parent(frames[:3]) == {}  # truncated before the parent
    assert claimed_parent([DELIMITER, b"", b"{}", b"[]"]) == {}
    assert claimed_parent([b"no delimiter"]) == {}


def test_encoding_refuses_what_json_cannot_say() -> None:
    with pytest.raises(ValueError):
        codec().encode("execute_request", {"x": float("nan")})
    _, frames = codec().encode("execute_request", {"code": "\udcff"})
    assert json.loads(frames[-1].decode("utf-8", errors="surrogateescape"))["code"] == "\udcff"


@pytest.mark.parametrize(
    "frame",
    [
        b'{"a": 1e400, "b": NaN, "c": -Infinity, "d": 12345678901234567890123}',
        b'{"a": "\\ud83d\\ude00", "b": "\\u0000", "a2": [1, {"x": null}], "a2": true}',
        '{"text": "é ü 漢字"}'.encode(),
        b'{"lone": "\\ud800"}',  # undecodable output, surrogate-escaped by a kernel
        b'{"cesu": "\xed\xa0\x80"}',  # a surrogate's UTF-8 bytes
        b'\xef\xbb\xbf{"bom": 1}',
        '{"utf16": 1}'.encode("utf-16"),
        b"[" * 300 + b"{}" + b"]" * 300,
    ],
)
def test_json_frames_parse_exactly_as_json_loads_does(frame: bytes) -> None:
    """The fast parser goes first; json.loads has the last word, so the codec reads what
    it read before, whatever the fast one refuses (a lone surrogate, a BOM, deep nesting)."""
    expected = json.loads(frame)
    if not isinstance(expected, dict):
        with pytest.raises(KernelMessageError, match="not an object"):
            unpack(frame, "content")
        return
    got = unpack(frame, "content")
    assert repr(got) == repr(expected)


@pytest.mark.parametrize("frame", [b'{"a": 1}x', b'{"a": "\x01"}', b'{"a": "\xff"}', b""])
def test_json_frames_that_json_loads_refuses_are_refused(frame: bytes) -> None:
    with pytest.raises(KernelMessageError, match="is not JSON"):
        unpack(frame, "content")
