"""The snapshot section: capture and restore against their floors.

Owned by the snapshot piece. With ``bench/snapshot_api.py`` present it measures through
the API at ``Plan.snapshot_sizes``; otherwise ``bench/snapshot.py``'s namespace in a host
kernel. Either way its numbers feed the snapshot chart (``charts.py``) when it can.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import snapshot
from harness import Suite
from report import Row
from rounds import Spread
from targets import at_most


async def snapshots(suite: Suite) -> list[Row]:
    try:
        snapshot_api = importlib.import_module("snapshot_api")
    except ImportError:
        return await _host_kernel(suite)
    sizes = suite.plan.snapshot_sizes
    rounds = max(suite.plan.snapshot_runs, 3)
    results = await snapshot_api.measure(list(sizes), rounds, suite.root / "gateway-snap")
    suite.series["snapshot"] = results  # objects with .mib and .median(name)
    suite.note(
        "snapshot",
        "Through the API, with a gateway of its own and Docker sandboxes (`bench/snapshot_api.py`):"
        f" numeric namespaces of {', '.join(f'{s} MiB' for s in sizes)} (four float64 arrays"
        " and a small dict). Floors: `pickle.dump(protocol=5)` and `pickle.load` of the same"
        " objects in the same sandbox (to its /workspace, a tmpfs), with dill beside them."
        " Restore is the `restore.duration` that `POST /v1/sessions` with `from_snapshot`"
        " returns (the gateway's timing of the restore alone: blob streamed in and hashed,"
        " the kernel's load), with the create less a plain create beside it as a cross-check."
        f" {rounds} interleaved rounds: median, spread min–max.",
    )
    return [row for s in results for row in judged(snapshot_api.rows([s]), s)]


def judged(rows: list[Row], s: Any) -> list[Row]:
    """``bench/snapshot_api.py``'s rows for one size with issue #19's targets as data, each
    beside the number it is judged on: the snapshot's per-round ratio to ``pickle.dump``
    (≤ 1.5×), the restore's time (≤ 2× ``pickle.load`` + 0.3 s, from this size's medians).
    ``s`` is its samples (``mib``, ``median(name)``, ``rounds[name]``, one value a round)."""
    snap = Spread.of([a / b for a, b in zip(s.rounds["snapshot"], s.rounds["dump"], strict=True)])
    restore_bound = 2 * s.median("load") + 0.3
    out = []
    for row in rows:
        if "API snapshot" in row.measurement:
            row = dataclasses.replace(row, target=at_most(1.5, issue="#19"), measured=snap)
        elif "API restore" in row.measurement:
            target = at_most(restore_bound, "s", why="2× pickle.load + 0.3 s", issue="#19")
            row = dataclasses.replace(row, target=target, measured=Spread.of(s.rounds["restore"]))
        out.append(row)
    return out


async def _host_kernel(suite: Suite) -> list[Row]:
    m = await snapshot.measure(suite.plan.snapshot_rows, suite.plan.snapshot_runs)
    suite.note(
        "snapshot",
        f"`bench/snapshot.py`'s namespace with {m.rows:,} rows ({m.variables} variables),"
        " in kernelhub's kernel run as a host process (snapshots to the host's TMPDIR, a disk"
        " here, a tmpfs in a sandbox). Floors: dill on the same objects in the same kernel."
        f" Captures: median of {m.runs}. The standalone script has the details.",
    )
    return snapshot.summary_rows(m)
