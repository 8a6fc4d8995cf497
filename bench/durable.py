"""Durability sections: what the default checkpoint after every cell costs a cell, and how
fast a hibernated session holding 100 MiB wakes on its next call.

Both run the standalone benchmarks' public ``measure`` (``checkpoints.py``, ``wake.py``),
each with a gateway, data directory, port and instance label of its own, and turn their
samples into rows with issue #20's and #19's targets.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

import checkpoints
import wake
from report import Row, ms, quantile, seconds, spread, times
from rounds import Spread
from targets import at_most

if TYPE_CHECKING:
    from harness import Suite

THINKS = (0.2, 0.0)  # an agent's pace, and the worst case: the next cell at once


def blocks(samples: Sequence[float], size: int) -> list[list[float]]:
    """Consecutive runs of ``size`` samples (``checkpoints.py`` alternates its two
    sessions block by block, so block i of each saw the same moment of the machine)."""
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


def block_ratio(on: Sequence[float], off: Sequence[float], size: int) -> Spread:
    """Mean latency with checkpoints on over off, block by block."""
    pairs = zip(blocks(on, size), blocks(off, size), strict=True)
    return Spread.of([statistics.fmean(a) / statistics.fmean(b) for a, b in pairs])


async def checkpoint_cost(suite: Suite) -> list[Row]:
    section = "checkpoint"
    cells = suite.plan.checkpoint_cells
    rows: list[Row] = []
    for think in THINKS:
        cpu: dict[str, dict[str, float]] = {}
        m = await checkpoints.measure(cells, think, None, checkpoints.CELLS, cpu)
        per_cell = {mode: cpu[mode]["kernel"] / len(m[mode]) for mode in ("on", "off")}
        size = checkpoints.BLOCK
        means = {mode: Spread.of([statistics.fmean(b) for b in blocks(m[mode], size)])
                 for mode in ("on", "off")}  # fmt: skip
        ratio = block_ratio(m["on"], m["off"], size)
        rows += [
            Row(section, f"small cell, {think:g} s think time: mean latency, checkpoints on",
                spread(means["on"]), f"{ms(means['off'].median)} (checkpoints off)", times(ratio),
                at_most(1.05, why="checkpoint ≤ 5% of the cell", issue="#19"), ratio),
            Row(section, f"small cell, {think:g} s think time: p99, checkpoints on",
                ms(quantile(m["on"], 0.99)), f"{ms(quantile(m['off'], 0.99))} (checkpoints off)",
                f"{quantile(m['on'], 0.99) / quantile(m['off'], 0.99):.2f}×"),
            Row(section, f"small cell, {think:g} s think time: kernel CPU per cell, checkpoints on",
                ms(per_cell["on"]), f"{ms(per_cell['off'])} (checkpoints off)",
                f"{per_cell['on'] / per_cell['off']:.2f}×"),
        ]  # fmt: skip
    suite.note(
        section,
        "`bench/checkpoints.py`: a gateway of its own, two sessions with the same ~100 MiB"
        " namespace (an array, a DataFrame, a dict), one with checkpoints on (the default,"
        " after every cell), one off (the floor); the same small cells over each session's"
        f" WebSocket, {cells} per session, in blocks of {checkpoints.BLOCK} alternating"
        " between the two. Think time is the client's pause before each cell (an agent's"
        " model writing the next one; 0 s is the worst case for a checkpoint taken between"
        " cells). Cells: median of the block means [min–max]; the ratio: per block pair."
        " Kernel CPU: the sandbox cgroup's cpuacct over the mode's cells."
        " Target: the checkpoint adds ≤ 5% to a cell.",
    )
    return rows


async def wake_time(suite: Suite) -> list[Row]:
    section = "wake"
    runs = suite.plan.wake_runs
    m = await wake.measure(runs)
    woke = Spread.of(m["wake"])
    per_cold = Spread.of([w / c for w, c in zip(m["wake"], m["cold"], strict=True)])
    end_to_end = Spread.of(m["wake_and_cell"])
    awake = statistics.median(m["awake"])
    suite.note(
        section,
        "`bench/wake.py`: a gateway of its own with `KERNELHUB_GATEWAY__HIBERNATE_AFTER=2`"
        " and default options (checkpoints on, a standby sandbox per hibernated session);"
        " the session holds a 100 MiB float array and a small dict, hibernates, and once its"
        " standby sandbox is ready its next execute is timed end to end. The wake is the"
        f" gateway's own `woke in` timing. {runs} runs; each run's cold start"
        " (`POST /v1/sessions`) is taken beside it as the floor.",
    )
    return [
        Row(section, "100 MiB session: wake (the gateway's own timing)", spread(woke, seconds),
            f"{seconds(statistics.median(m['cold']))} (cold start)", times(per_cold),
            at_most(1.0, "s", why="100 MiB", issue="#19"), woke),
        Row(section, "100 MiB session: next execute after hibernation, end to end",
            spread(end_to_end, seconds), f"{ms(awake)} (the same cell, awake)",
            f"{end_to_end.median / awake:.1f}×"),
    ]  # fmt: skip
