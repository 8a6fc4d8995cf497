"""The benchmark's sampling: interleaved rounds with rotating order, warm-up, spreads."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from report import seconds, spread, times
from rounds import Rounds, Spread, interleave, rotated


def recorder(log: list[str], name: str, values: list[float]) -> Callable[[], Awaitable[float]]:
    it = iter(values)

    async def run() -> float:
        log.append(name)
        return next(it)

    return run


def test_rotated_starts_each_round_with_the_next_contender() -> None:
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert rotated(["a", "b", "c"], 5) == ["c", "a", "b"]


async def test_interleave_warms_up_then_rotates_the_order_each_round() -> None:
    log: list[str] = []
    runners = {
        "a": recorder(log, "a", [99, 1, 2, 3, 4, 5, 6]),
        "b": recorder(log, "b", [99, 10, 20, 30, 40, 50, 60]),
    }
    got = await interleave(runners, rounds=3, per_round=2, warmup=1)
    # one warm-up turn, then round 0 a-first, round 1 b-first, round 2 a-first
    assert log == ["a", "b", *"abab", *"baba", *"abab"]
    # the warm-up's samples are not kept; each round keeps its own
    assert got.samples == {"a": [[1, 2], [3, 4], [5, 6]], "b": [[10, 20], [30, 40], [50, 60]]}


def test_spread_is_the_median_of_round_medians_and_their_range() -> None:
    r = Rounds({"x": [[1.0, 3.0, 2.0], [10.0, 10.0, 11.0], [4.0, 5.0, 6.0]]})
    assert r.spread("x") == Spread(5.0, 2.0, 10.0)
    assert r.spread("x", max) == Spread(6.0, 3.0, 11.0)
    assert r.pooled("x") == [1.0, 3.0, 2.0, 10.0, 10.0, 11.0, 4.0, 5.0, 6.0]


def test_a_ratio_is_taken_round_by_round() -> None:
    # round 2 is slow for both: per-round ratios stay 2x, a ratio of pooled medians would not
    r = Rounds({"ours": [[2.0], [2.2], [20.0]], "floor": [[1.0], [1.1], [10.0]]})
    assert r.ratio("ours", "floor") == Spread(2.0, 2.0, 2.0)


def test_formatting_names_median_and_range() -> None:
    assert spread(Spread(0.00744, 0.0071, 0.0079)) == "7.44 ms [7.10–7.90]"
    # a range across units keeps both
    assert spread(Spread(0.9, 0.8, 1.2), seconds) == "900.00 ms [800.00 ms–1.20 s]"
    assert spread(Spread(120.0, 100.0, 130.0), lambda x: f"{x:.0f}/s") == "120/s [100/s–130/s]"
    assert times(Spread(1.344, 1.2, 1.51)) == "1.34× [1.20–1.51]"


def test_no_values_no_spread() -> None:
    with pytest.raises(ValueError):
        Spread.of([])
