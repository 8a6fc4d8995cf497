"""The issues' targets as data: how each reads, and the verdict a row's number earns."""

from __future__ import annotations

import pytest
from rounds import Spread
from targets import MiB, Target, at_least, at_most, verdict


def test_targets_read_as_the_issues_write_them() -> None:
    assert str(at_most(1.15)) == "≤ 1.15×"
    assert str(at_least(0.9, issue="#20")) == "≥ 0.9× (#20)"
    assert str(at_most(0.1, "s")) == "≤ 100 ms"
    assert str(at_most(1.0, "s", why="100 MiB", issue="#19")) == "≤ 1 s (100 MiB, #19)"
    assert str(at_most(16 * MiB, "bytes")) == "≤ 16 MiB"
    assert str(at_most(0.7734, "s", why="2× pickle.load + 0.3 s")) == (
        "≤ 773.4 ms (2× pickle.load + 0.3 s)"
    )


def test_a_plain_number_is_met_or_not() -> None:
    assert verdict(at_most(1.5), 1.5) == "met"
    assert verdict(at_most(1.5), 1.51) == "not met"
    assert verdict(at_least(0.9), 0.95) == "met"
    assert verdict(at_least(0.9), 0.89) == "not met"
    assert verdict(at_most(16 * MiB, "bytes"), 17 * MiB) == "not met"


def test_the_median_decides_and_a_missed_round_is_said() -> None:
    assert verdict(at_most(1.15), Spread(1.10, 1.05, 1.12)) == "met"
    assert verdict(at_most(1.15), Spread(1.13, 1.10, 1.74)) == "met (not every round)"
    assert verdict(at_most(1.15), Spread(1.20, 1.01, 1.30)) == "not met"
    # for a lower bound the worst round is the lowest
    assert verdict(at_least(0.9), Spread(0.95, 0.85, 1.0)) == "met (not every round)"
    assert verdict(at_least(0.9), Spread(0.87, 0.81, 0.89)) == "not met"


def test_no_target_no_verdict_and_text_is_not_checked() -> None:
    assert verdict("", 1.0) == ""
    assert verdict("≤ 1.5×", 1.0) == "not checked"  # typed by hand: nothing to compute
    assert verdict(at_most(1.5), None) == "not checked"


def test_a_target_refuses_what_it_cannot_judge() -> None:
    with pytest.raises(ValueError, match="op"):
        Target("<", 1.0)
    with pytest.raises(ValueError, match="unit"):
        Target("≤", 1.0, "ms")
