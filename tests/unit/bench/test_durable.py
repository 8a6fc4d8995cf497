"""The checkpoint section's pairing: block i of each session was taken side by side."""

from __future__ import annotations

import pytest
from durable import block_ratio, blocks


def test_blocks_are_consecutive_runs() -> None:
    assert blocks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_the_ratio_is_taken_block_by_block() -> None:
    # the second block is slow for both sessions: per block the ratio stays 1.1
    on = [0.011] * 10 + [0.110] * 10
    off = [0.010] * 10 + [0.100] * 10
    got = block_ratio(on, off, 10)
    assert [got.median, got.lo, got.hi] == pytest.approx([1.1, 1.1, 1.1])


def test_unpaired_blocks_are_an_error() -> None:
    with pytest.raises(ValueError):
        block_ratio([1.0] * 20, [1.0] * 10, 10)
