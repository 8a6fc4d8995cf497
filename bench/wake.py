"""Hibernation with default options: how long a session holding 100 MiB wakes on its next
call, beside a cold start and the same cell on an awake session, in one run.

    python bench/wake.py [--runs 3] [--out docs/bench-wake.md]

A gateway of its own with ``KERNELHUB_GATEWAY__HIBERNATE_AFTER=2`` and otherwise default
settings (checkpoints on, a standby sandbox for each hibernated session). The session gets
a 100 MiB float array and a small dict, goes idle, hibernates; once its standby sandbox is
ready (the gateway logs it: an agent's next call comes minutes later, not at once) the
next execute is timed end to end (wake + restore + the cell). The gateway's own ``woke in``
line gives the wake alone. Floors, measured in the same run: ``POST /v1/sessions`` (a cold
start, which a wake without standby pays first) and the same cell on the awake session.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway import Gateway, create_session, create_timed, delete_session, rest_roundtrip
from report import MiB, seconds

STATE = "import numpy as np\nbig = np.arange(100 * 2**20 // 8, dtype='float64')\nsmall = {'n': 1}"
CELL = "total = float(big[:10].sum()) + small['n']"


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        await asyncio.sleep(0.1)


async def measure(runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"wake": [], "wake_and_cell": [], "cold": [], "awake": []}
    with tempfile.TemporaryDirectory(prefix="kh-bench-wake-") as tmp:
        gw = await Gateway.launch(
            Path(tmp),
            instance=f"bwk-{uuid.uuid4().hex[:6]}",
            env={"KERNELHUB_GATEWAY__HIBERNATE_AFTER": "2", "KERNELHUB_POOL__SIZE": "0"},
        )
        try:
            async with gw.client() as http:
                sid = await create_session(http, {"limits": {"memory_bytes": 1024 * MiB}})
                r = await http.post(
                    f"/v1/sessions/{sid}/executions", json={"code": STATE, "wait": True}
                )
                assert r.json()["status"] == "completed", r.text
                for _ in range(runs):
                    out["awake"].append(await rest_roundtrip(http, sid, CELL))

                    async def hibernated() -> bool:
                        info = (await http.get(f"/v1/sessions/{sid}")).json()
                        return bool(info["state"] == "hibernated")

                    mark = f"session {sid}: standby sandbox ready"
                    before = gw.log.read_text().count(mark)
                    await wait_for(hibernated, 120)

                    async def standby(mark: str = mark, before: int = before) -> bool:
                        return gw.log.read_text().count(mark) > before

                    await wait_for(standby, 120)
                    out["wake_and_cell"].append(await rest_roundtrip(http, sid, CELL))
                    woke = re.findall(rf"session {sid} woke in ([0-9.]+) s", gw.log.read_text())
                    out["wake"].append(float(woke[-1]))
                    cold, info = await create_timed(http)
                    out["cold"].append(cold)
                    await delete_session(http, info["id"])
                await delete_session(http, sid)
        finally:
            await gw.stop()
    return out


def report(m: dict[str, list[float]]) -> str:
    med = {k: statistics.median(v) for k, v in m.items()}
    rows = [
        "| measurement | median | samples | floor |",
        "|---|---|---|---|",
        f"| wake (gateway's own timing) | {seconds(med['wake'])} | "
        + ", ".join(seconds(x) for x in m["wake"])
        + f" | cold start {seconds(med['cold'])} |",
        f"| next execute after hibernation, end to end | {seconds(med['wake_and_cell'])} | "
        + ", ".join(seconds(x) for x in m["wake_and_cell"])
        + f" | same cell awake {seconds(med['awake'])} |",
        f"| cold start (`POST /v1/sessions`) | {seconds(med['cold'])} | "
        + ", ".join(seconds(x) for x in m["cold"])
        + " | |",
    ]
    return "\n".join(rows) + "\n\nTarget: a 100 MiB namespace wakes in ≤ 1.0 s.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = report(asyncio.run(measure(args.runs)))
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
