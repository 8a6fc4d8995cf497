"""How much a client catching up from the store is given at once, and how a big event's
frame is cut (gateway/stream.py)."""

from __future__ import annotations

from kernelhub import jsonslices
from kernelhub.gateway.stream import _event_frame, event_frame_parts, replay_page

MiB = 2**20


def test_a_replay_page_holds_about_the_client_buffer() -> None:
    # Large events: the next page shrinks to what fits the buffer, never below one.
    assert replay_page(8, 8 * 100_000, MiB) == 10
    assert replay_page(10, 10 * 4 * MiB, MiB) == 1
    # Small events: it grows, up to the most one query returns.
    assert replay_page(8, 8 * 200, MiB) == 500
    assert replay_page(500, 500 * 3000, MiB) == 349
    assert replay_page(8, 0, MiB) == 500  # nothing measured (empty bodies): the most


def test_a_big_events_frame_is_the_same_bytes_in_slice_sized_pieces() -> None:
    for body in ('{"a":1}', '{"t":"' + "é€\U0001f600x" * (jsonslices.SLICE // 2) + '"}'):
        parts = event_frame_parts(body)
        assert b"".join(parts) == _event_frame(body).encode()
        if len(body) >= 2 * jsonslices.SLICE:
            assert len(parts) > 2 and max(len(p) for p in parts) <= 4 * jsonslices.SLICE
