"""The report's pure parts: the results table with its computed "met" column, the
sections' timings, and the README block rewritten from a run."""

from __future__ import annotations

import pytest
from report import BLOCK_END, BLOCK_START, Row, headline, markdown, rewrite_block
from rounds import Spread
from targets import at_least, at_most

ROWS = [
    Row("exec", "`1+1`, floor", "6.76 ms [6.47–7.26]"),
    Row("exec", "`1+1`, gateway WebSocket", "8.14 ms", "6.76 ms", "1.13× [1.10–1.74]",
        at_most(1.15, issue="#20"), Spread(1.13, 1.10, 1.74)),
    Row("concurrency", "50 sessions: throughput", "177/s", "224/s", "0.77×", at_least(0.9),
        Spread(0.77, 0.66, 1.07)),
    Row("cold start", "gateway", "1.2 s", "1.1 s", "1.03×", at_most(1.05), Spread(1.03, 1.0, 1.04)),
]  # fmt: skip


def test_the_results_table_computes_met_from_each_rows_number() -> None:
    text = markdown(
        title="Benchmarks", preamble=["p"], machine=[("CPU", "x")], rows=ROWS, notes=[],
        sections=[("exec", 123.4, "1.00, 2.00, 3.00")],
    )  # fmt: skip
    lines = text.splitlines()
    assert (
        "| section | measurement | kernelhub | floor (same run) | ratio | target | met |" in lines
    )
    assert "| exec | 123 s | 1.00, 2.00, 3.00 |" in lines
    ws = next(line for line in lines if "gateway WebSocket" in line)
    assert ws.endswith("| ≤ 1.15× (#20) | met (not every round) |")
    assert next(line for line in lines if "throughput" in line).endswith("| ≥ 0.9× | not met |")
    assert next(line for line in lines if "floor" in line and "exec |" in line).endswith("|  |  |")


def test_the_headline_is_every_targeted_row() -> None:
    block = headline(ROWS, "From `python bench/suite.py` on 2026-12-02.")
    lines = block.splitlines()
    assert lines[0] == "From `python bench/suite.py` on 2026-12-02. 2 of 3 targets met."
    assert len([line for line in lines if line.startswith("| ")]) == 1 + 3  # header + rows
    assert "| cold start: gateway | 1.2 s | 1.03× | ≤ 1.05× | met |" in lines
    assert not any("`1+1`, floor" in line for line in lines)


def test_the_readme_block_is_replaced_between_its_markers_only() -> None:
    readme = f"# x\n\nintro\n{BLOCK_START}\nold numbers\n{BLOCK_END}\n\nafter\n"
    once = rewrite_block(readme, "| new |\n")
    assert once == f"# x\n\nintro\n{BLOCK_START}\n| new |\n{BLOCK_END}\n\nafter\n"
    assert rewrite_block(once, "| new |") == once  # idempotent
    assert rewrite_block(once, "other").count("other") == 1


@pytest.mark.parametrize(
    "text",
    ["no markers", f"{BLOCK_END}\n{BLOCK_START}", f"{BLOCK_START}\n{BLOCK_START}\n{BLOCK_END}",
     f"{BLOCK_START}\nonly a start"],
)  # fmt: skip
def test_a_readme_without_one_ordered_pair_of_markers_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="bench:start"):
        rewrite_block(text, "x")
