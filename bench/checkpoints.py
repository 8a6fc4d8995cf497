"""What default checkpoints cost a cell: a session holding ~100 MiB of state runs small
cells with checkpoints on (the default) and off, in the same gateway, in alternating blocks.

    python bench/checkpoints.py [--cells 60] [--think 0.2] [--grace 0.05] [--out FILE]

Two sessions, created alike (1 GiB of memory), each given the same ~100 MiB namespace (a
float array, a DataFrame, a dict of small values) and then the same small cells, one at a
time over each session's WebSocket stream (execute to its ``final`` event), in blocks of
ten alternating between the two sessions so that both see the same machine load. The
checkpoint's cost is the difference between the sessions; the floor is the same session
with checkpoints off. Between two cells the client waits ``--think`` seconds, as an agent
does while its model writes the next cell (seconds, usually: 0.2 s is a fast agent);
``--think 0`` sends each cell as soon as the previous answered, the worst case for a
checkpoint taken between cells. ``--grace`` sets KERNELHUB_GATEWAY__CHECKPOINT_GRACE (see
``kernelhub/session/checkpoints.py``: 0, the default, checkpoints after every cell and a
cell sent meanwhile waits; more coalesces a burst). The checkpoint itself is incremental:
only what the cell may have changed is pickled again, the rest hard-linked.

Beside the latencies, CPU per cell for each mode: the kernel's (its container's cgroup
cpuacct) and the gateway process's, over that mode's blocks. On a shared machine these
are steadier than wall time; on minus off is what a checkpoint costs each side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
from gateway import Gateway, WsSession, create_session, delete_session
from report import MiB, ms, quantile

STATE = """\
import numpy as np, pandas as pd
big = np.random.default_rng(1).random(50 * 2**20 // 8)
frame = pd.DataFrame({'a': np.arange(2**20 * 3, dtype='int64'), 'b': np.ones(2**20 * 3)})
small = {f'k{i}': i for i in range(1000)}
counter = 0
"""
BLOCK = 10
BETWEEN_BLOCKS = 0.5
CELLS = [
    "counter += 1",
    "small['k1'] = counter",
    "total = float(big[:1000].sum())",
    "rows = len(frame)",
    "note = f'step {counter}'",
]
# ``--read-only``: cells that change nothing a checkpoint keeps (the kernel says so and
# the gateway takes no capture after them: kernelhub_unchanged_since).
READ_ONLY_CELLS = [
    "print(counter)",
    "len(frame)",
    "float(big[:1000].sum())",
    "small['k1']",
    "f'step {counter}'",
]


def kernel_cpu(sid: str) -> Callable[[], float]:
    """CPU seconds the session's sandbox (kernel container) has used: its cgroup's
    cpuacct, steadier than wall time on a shared machine."""
    cid = subprocess.run(
        ["docker", "ps", "-q", "--no-trunc", "--filter", f"label=org.kernelhub.session={sid}"],
        capture_output=True, text=True, check=True,
    ).stdout.split()[0]  # fmt: skip
    v1 = Path(f"/sys/fs/cgroup/cpuacct/docker/{cid}/cpuacct.usage")
    if v1.exists():
        return lambda: int(v1.read_text()) / 1e9
    v2 = Path(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/cpu.stat")

    def usage() -> float:
        line = next(x for x in v2.read_text().splitlines() if x.startswith("usage_usec"))
        return int(line.split()[1]) / 1e6

    return usage


def process_cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def cell_latencies(
    gw: Gateway,
    sids: dict[str, str],
    cells: int,
    think: float,
    cells_run: list[str],
    cpu: dict[str, dict[str, float]],
) -> dict[str, list[float]]:
    """Latency of each cell per mode; ``cpu[mode]`` gets the kernel's and the gateway's
    CPU seconds over that mode's blocks (each block's checkpoints included: the pause
    after a block lets the last one end before the reading)."""
    out: dict[str, list[float]] = {mode: [] for mode in sids}
    assert gw.proc is not None
    gateway_pid = gw.proc.pid
    for mode in sids:
        cpu[mode] = {"kernel": 0.0, "gateway": 0.0}
    clients = {mode: WsSession(gw, sid) for mode, sid in sids.items()}  # one stream each
    for ws in clients.values():
        await ws.__aenter__()
    try:
        for mode in sids:
            await clients[mode].run(STATE)
        kernels = {mode: kernel_cpu(sid) for mode, sid in sids.items()}  # started by now
        # Blocks of BLOCK cells per session, alternating: with no think time, a session's
        # checkpoint would otherwise run while the other session's cell does, and charge
        # the other one for it (2 cores); between blocks, an unmeasured pause lets it end.
        for start in range(0, cells, BLOCK):
            for mode in sids:
                k0, g0 = kernels[mode](), process_cpu(gateway_pid)
                for i in range(start, min(start + BLOCK, cells)):
                    if think:
                        await asyncio.sleep(think)
                    code = cells_run[i % len(cells_run)]
                    out[mode].append(await clients[mode].run(code))
                await asyncio.sleep(BETWEEN_BLOCKS)
                cpu[mode]["kernel"] += kernels[mode]() - k0
                cpu[mode]["gateway"] += process_cpu(gateway_pid) - g0
    finally:
        for ws in clients.values():
            await ws.__aexit__()
    return out


async def measure(
    cells: int,
    think: float,
    grace: float | None,
    cells_run: list[str],
    cpu: dict[str, dict[str, float]],
) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="kh-bench-ckpt-") as tmp:
        instance = f"bck-{uuid.uuid4().hex[:6]}"
        env = {"KERNELHUB_GATEWAY__HIBERNATE_AFTER": "3600"}
        if grace is not None:
            env["KERNELHUB_GATEWAY__CHECKPOINT_GRACE"] = str(grace)
        gw = await Gateway.launch(Path(tmp), instance=instance, env=env)
        try:
            async with gw.client() as http:
                limits = {"memory_bytes": 1024 * MiB}
                sids = {
                    "on": await create_session(
                        http, {"limits": limits, "checkpoints": "every_cell"}
                    ),
                    "off": await create_session(http, {"limits": limits, "checkpoints": "off"}),
                }
                try:
                    return await cell_latencies(gw, sids, cells, think, cells_run, cpu)
                finally:
                    for sid in sids.values():
                        await delete_session(http, sid)
        finally:
            await gw.stop()


def report(
    results: dict[float, dict[str, list[float]]], cpu: dict[float, dict[str, dict[str, float]]]
) -> str:
    lines = [
        "| think time | checkpoints | mean | p50 | p99 | added to the mean "
        "| kernel CPU / cell | gateway CPU / cell |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for think, m in results.items():
        base = statistics.fmean(m["off"])
        for mode in ("off", "on"):
            s = m[mode]
            mean = statistics.fmean(s)
            added = "floor" if mode == "off" else f"{(mean - base) / base * 100:+.1f}%"
            used = cpu[think][mode]
            lines.append(
                f"| {think:g} s | {mode} | {ms(mean)} | {ms(quantile(s, 0.5))} "
                f"| {ms(quantile(s, 0.99))} | {added} | {ms(used['kernel'] / len(s))} "
                f"| {ms(used['gateway'] / len(s))} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=60)
    parser.add_argument("--think", type=float, action="append")
    parser.add_argument(
        "--grace", type=float, default=None, help="KERNELHUB_GATEWAY__CHECKPOINT_GRACE (s)"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--read-only", action="store_true", help="cells that change nothing")
    args = parser.parse_args()
    thinks = args.think or [0.2, 0.0]
    t0 = time.monotonic()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cells_run = READ_ONLY_CELLS if args.read_only else CELLS
    cpu: dict[float, dict[str, dict[str, float]]] = {t: {} for t in thinks}
    results = {
        t: asyncio.run(measure(args.cells, t, args.grace, cells_run, cpu[t])) for t in thinks
    }
    grace = "the default" if args.grace is None else f"{args.grace:g} s"
    text = (
        report(results, cpu)
        + f"\n{args.cells} cells per session and think time, checkpoint grace {grace},"
        f" {time.monotonic() - t0:.0f} s in all; load average at the start {load}.\n"
    )
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
