"""Message bounds (``kernelhub_kernel/bounds.py``) on jupyter_client's real ``Session``:
a message over the limit is cut visibly, one under it is untouched."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jupyter_client.session import Session

from tests.unit.kernel_image.loader import load

bounds = load("bounds")

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def session() -> Any:
    class Bounded(Session):
        pass

    bounds.bound_messages(Bounded, LIMIT)
    return Bounded(key=b"k")


def sent(session: Any, content: dict[str, Any], metadata: Any = None) -> tuple[int, Any, Any]:
    msg = session.msg("display_data", content, metadata=metadata or {})
    frames = session.serialize(msg)
    size = sum(len(f) for f in frames)
    # frames: [DELIM, signature, header, parent, metadata, content]
    return size, json.loads(frames[-1]), json.loads(frames[-2])


def test_a_small_message_is_sent_as_is(session: Any) -> None:
    content = {"data": {"text/plain": "hello"}, "metadata": {}}
    size, out, _ = sent(session, content)
    assert out == content
    assert size < LIMIT


def test_a_huge_string_keeps_head_and_tail_and_names_the_cut(session: Any) -> None:
    text = "HEAD" + "x" * (1 << 20) + "TAIL"
    size, out, _ = sent(session, {"data": {"text/plain": text}, "metadata": {}})
    assert size <= LIMIT
    plain = out["data"]["text/plain"]
    assert plain.startswith("HEAD") and plain.endswith("TAIL")
    assert "bytes dropped" in plain
    marker = out[bounds._TRUNCATED_KEY]
    assert marker["original_bytes"] > 1 << 20
    assert marker["limit_bytes"] == LIMIT


def test_a_cut_binary_mime_entry_is_dropped_with_a_note(session: Any) -> None:
    image = "iVBOR" * 100_000
    size, out, _ = sent(session, {"data": {"image/png": image}, "metadata": {}})
    assert size <= LIMIT
    assert "image/png" not in out["data"]
    assert "image/png output dropped" in out["data"]["text/plain"]


def test_long_lists_and_dicts_keep_their_ends_and_count_the_rest(session: Any) -> None:
    content = {"items": list(range(50_000)), "table": {f"k{i}": i for i in range(50_000)}}
    size, out, _ = sent(session, content)
    assert size <= LIMIT
    items = out["items"]
    assert items[0] == 0 and items[-1] == 49_999
    assert any(isinstance(i, str) and "items dropped" in i for i in items)
    assert "entries dropped" in out["table"]["..."]


def test_huge_metadata_is_cut_too(session: Any) -> None:
    size, _, metadata = sent(session, {"data": {}}, metadata={"blob": "m" * (1 << 20)})
    assert size <= LIMIT
    assert "bytes dropped" in metadata["blob"]


def test_deep_nesting_is_cut_at_a_depth() -> None:
    value: Any = "leaf"
    for _ in range(100):
        value = [value]
    out = bounds._cap(value, 1000, 0)
    depth = 0
    while isinstance(out, list):
        out, depth = out[0], depth + 1
    assert depth == bounds._MAX_DEPTH
    assert out == "[... nested too deep ...]"


@pytest.mark.parametrize("text", ["short", "é" * 10, "x" * 300])
def test_text_that_fits_is_never_cut(text: str) -> None:
    assert bounds._cut_text(text, 4 * len(text)) == text


def test_a_cut_never_splits_a_utf8_character() -> None:
    cut = bounds._cut_text("é" * 10_000, 1000)
    assert len(cut.encode()) <= 1000 + 64
    assert cut.startswith("é") and cut.endswith("é")
    dropped = int(cut.split("[... ")[1].split(" bytes")[0])
    assert dropped == 20_000 - 2 * (1000 // 2 - 32)
