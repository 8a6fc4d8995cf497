"""The snapshot section: capture and restore against their floors.

Owned by the snapshot piece. With ``bench/snapshot_api.py`` present it measures through
the API at ``Plan.snapshot_sizes``; otherwise ``bench/snapshot.py``'s namespace in a host
kernel. Either way its numbers feed the snapshot chart (``charts.py``) when it can.
"""

from __future__ import annotations

import importlib

import snapshot
from harness import Suite
from report import Row


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
    rows: list[Row] = snapshot_api.rows(results)
    return rows


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
