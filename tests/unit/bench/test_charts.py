"""The suite's charts: drawn from a run's series, absent when the run has none."""

from __future__ import annotations

from pathlib import Path

import charts
from rounds import Spread


class SizeSamples:
    """Shaped like bench/snapshot_api.py's samples: ``mib`` and ``median(name)``."""

    def __init__(self, mib: int, medians: dict[str, float]) -> None:
        self.mib, self._medians = mib, medians

    def median(self, name: str) -> float:
        return self._medians[name]


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_concurrency_and_snapshot_charts_are_drawn(tmp_path: Path) -> None:
    s = Spread(0.01, 0.008, 0.02)
    levels = {
        n: {
            name: {"rate": Spread(100.0 * k, 90.0 * k, 110.0 * k), "p50": s, "p99": s}
            for name in ("kernelhub", "floor")
        }
        for k, n in enumerate((10, 50), start=1)
    }
    levels[10]["peer"] = {"rate": Spread(50.0, 40.0, 60.0), "p50": s, "p99": s}
    sizes = [
        SizeSamples(
            m,
            {
                "snapshot": m / 100,
                "dump": m / 120,
                "dill_dump": m / 90,
                "load": m / 200,
                "dill_load": m / 180,
                "restore": m / 150,
            },
        )
        for m in (100, 10)
    ]
    sizes.append(SizeSamples(500, {"snapshot": 5, "dump": 4, "load": 2, "restore": 3}))  # no dill
    drawn = charts.draw({"concurrency": levels, "snapshot": sizes}, tmp_path)
    assert [path.name for _, path in drawn] == ["bench-concurrency.png", "bench-snapshot-size.png"]
    assert all(is_png(path) for _, path in drawn)


def test_no_numbers_no_chart(tmp_path: Path) -> None:
    assert charts.draw({}, tmp_path) == []
    assert list(tmp_path.iterdir()) == []
