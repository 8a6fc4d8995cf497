"""How much a client catching up from the store is given at once (gateway/stream.py)."""

from __future__ import annotations

from kernelhub.gateway.stream import replay_page

MiB = 2**20


def test_a_replay_page_holds_about_the_client_buffer() -> None:
    # Large events: the next page shrinks to what fits the buffer, never below one.
    assert replay_page(8, 8 * 100_000, MiB) == 10
    assert replay_page(10, 10 * 4 * MiB, MiB) == 1
    # Small events: it grows, up to the most one query returns.
    assert replay_page(8, 8 * 200, MiB) == 500
    assert replay_page(500, 500 * 3000, MiB) == 349
    assert replay_page(8, 0, MiB) == 500  # nothing measured (empty bodies): the most
