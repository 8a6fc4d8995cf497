"""Gateway RSS growth while relaying 50 MB of stdout (issue #20), two trees interleaved.

    python bench/relay_rss.py [--rounds 3] [--base /work/main]

Starts one gateway from this tree and one from ``--base`` (each its own data directory,
instance and port, pool off), then runs ``gateway.BIG_OUTPUT`` over a WebSocket on each
in turn, rotating which goes first; prints each round's peak RSS growth (sampled every
20 ms) and wall time to the ``final`` frame, and the machine's load average. Needs Docker and the kernel image.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import uuid
from pathlib import Path

import gateway
import httpx

MiB = 1 << 20
HERE = Path(__file__).resolve().parent.parent


async def main(rounds: int, base: Path) -> None:
    trees = {"base": base, "this": HERE}
    gws: dict[str, gateway.Gateway] = {}
    growth: dict[str, list[float]] = {name: [] for name in trees}
    walls: dict[str, list[float]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="relay-rss-") as root:
        try:
            for name, tree in trees.items():
                data = Path(root) / name
                data.mkdir()
                gws[name] = await gateway.Gateway.launch(
                    data,
                    instance=f"relayrss-{uuid.uuid4().hex[:6]}-{name}",
                    env={"KERNELHUB_POOL__SIZE": "0", "PYTHONPATH": str(tree)},
                )
            for r in range(rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for name in order:
                    gw = gws[name]
                    async with httpx.AsyncClient(
                        base_url=gw.url, headers=gw.headers, timeout=120
                    ) as http:
                        wall, grew = await gateway.big_output(gw, http)
                    growth[name].append(grew / MiB)
                    walls[name].append(wall)
                    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
                    print(f"round {r} {name}: +{grew / MiB:.1f} MiB in {wall:.2f} s (load {load})")
        finally:
            for gw in gws.values():
                await gw.stop()
    for name, g in growth.items():
        w = walls[name]
        print(
            f"{name}: RSS growth median +{statistics.median(g):.1f} MiB [{min(g):.1f}-{max(g):.1f}],"
            f" wall {statistics.median(w):.2f} s [{min(w):.2f}-{max(w):.2f}]"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--base", type=Path, default=Path("/work/main"))
    a = p.parse_args()
    asyncio.run(main(a.rounds, a.base))
