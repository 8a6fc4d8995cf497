"""Charts the suite draws from its own numbers (matplotlib, Agg), as PNGs beside the report.

- concurrency: throughput and cell latency (p50, p99) against concurrent sessions, for
  kernelhub, its floor (as many stock kernels) and the peer, with each round's [min–max];
- snapshot: capture and restore time against namespace size, beside pickle's floors and
  dill.

Each returns the PNG's path, or None when the run has no numbers for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display here
import matplotlib.pyplot as plt

LABELS = {"kernelhub": "kernelhub (WebSocket, sandboxed)",
          "floor": "floor: as many stock ipykernels (jupyter_client)",
          "peer": "Jupyter Kernel Gateway + TCP_NODELAY"}  # fmt: skip
SHORT = {"kernelhub": "kernelhub", "floor": "stock kernels", "peer": "JKG + NODELAY"}
STYLE = {"kernelhub": "C0", "floor": "C7", "peer": "C1"}


def _errorbar(ax: Any, xs: list[int], spreads: list[Any], scale: float, **kw: Any) -> None:
    mids = [s.median * scale for s in spreads]
    lo = [(s.median - s.lo) * scale for s in spreads]
    hi = [(s.hi - s.median) * scale for s in spreads]
    ax.errorbar(xs, mids, yerr=[lo, hi], capsize=3, marker="o", **kw)


def concurrency(levels: dict[int, dict[str, dict[str, Any]]], out: Path) -> Path | None:
    """``levels[n][contender]`` has Spreads ``rate`` (cells/s), ``p50`` and ``p99`` (s)."""
    if not levels:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in LABELS:
        xs = [n for n in sorted(levels) if name in levels[n]]
        if not xs:
            continue
        color = STYLE[name]
        _errorbar(left, xs, [levels[n][name]["rate"] for n in xs], 1, color=color,
                  label=LABELS[name])  # fmt: skip
        _errorbar(right, xs, [levels[n][name]["p99"] for n in xs], 1000, color=color,
                  label=f"{SHORT[name]} p99")  # fmt: skip
        _errorbar(right, xs, [levels[n][name]["p50"] for n in xs], 1000, color=color,
                  linestyle="--", label=f"{SHORT[name]} p50")  # fmt: skip
    left.set(title="throughput", xlabel="concurrent sessions", ylabel="cells/s")
    right.set(title="cell latency (`1+1`)", xlabel="concurrent sessions", ylabel="ms")
    left.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    left.legend(fontsize=8)
    right.legend(fontsize=7, ncol=2)
    for ax in (left, right):
        ax.set_xticks(sorted(levels))  # the levels measured, not a scale between them
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


SNAPSHOT_PANELS = (
    ("snapshot", [("snapshot", "kernelhub snapshot (API)", "o-", "C0"),
                  ("dump", "floor: pickle.dump (protocol 5)", "o--", "C7"),
                  ("dill_dump", "dill.dump", "o:", "C1")]),
    ("restore", [("restore", "kernelhub restore (minus a cold start)", "s-", "C2"),
                 ("load", "floor: pickle.load", "s--", "C7"),
                 ("dill_load", "dill.load", "s:", "C1")]),
)  # fmt: skip
# Issue #19's targets, drawn from each size's floor: (floor, label, bound of the floor).
SNAPSHOT_TARGETS: dict[str, tuple[str, str, Callable[[float], float]]] = {
    "snapshot": ("dump", "target: 1.5× pickle.dump", lambda floor: 1.5 * floor),
    "restore": ("load", "target: 2× pickle.load + 0.3 s", lambda floor: 2 * floor + 0.3),
}


def _median_or_none(sample: Any, name: str) -> float | None:
    try:
        return float(sample.median(name))
    except (KeyError, ValueError):  # a run without that contender (dill, say)
        return None


def _plot(ax: Any, points: list[Any], name: str, value: Callable[[float], float], style: str,
          **kw: Any) -> None:  # fmt: skip
    xy = [(s.mib, value(y)) for s in points if (y := _median_or_none(s, name)) is not None]
    if xy:
        ax.plot(*zip(*xy, strict=True), style, **kw)


def snapshot(results: list[Any], out: Path) -> Path | None:
    """``results``: objects with ``mib`` and ``median(name)`` for ``snapshot``, ``dump``,
    ``dill_dump``, ``restore``, ``load`` and ``dill_load`` (``bench/snapshot_api.py``'s
    samples); a contender a run lacks is left out. Each panel also draws its target."""
    points = sorted(results, key=lambda s: s.mib)
    if not points:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (title, lines) in zip(axes, SNAPSHOT_PANELS, strict=True):
        for name, label, style, color in lines:
            _plot(ax, points, name, float, style, color=color, label=label)
        floor, label, bound = SNAPSHOT_TARGETS[title]
        _plot(ax, points, floor, bound, "-", color="C3", linewidth=0.8, alpha=0.6, label=label)
        ax.set(title=f"{title} against namespace size", xlabel="numeric namespace (MiB)",
               ylabel="seconds (median of rounds)")  # fmt: skip
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def draw(series: dict[str, Any], docs: Path) -> list[tuple[str, Path]]:
    """Every chart this run has numbers for: (title, path) pairs."""
    drawn: list[tuple[str, Path]] = []
    if (
        path := concurrency(series.get("concurrency", {}), docs / "bench-concurrency.png")
    ) is not None:
        drawn.append(("Throughput and latency against concurrent sessions", path))
    if (path := snapshot(series.get("snapshot", []), docs / "bench-snapshot-size.png")) is not None:
        drawn.append(("Snapshot and restore against namespace size", path))
    return drawn
