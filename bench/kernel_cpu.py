"""Kernel CPU per `1+1` cell, counted by ``perf stat`` (instructions and task-clock), for
our kernel from two kernel-image trees and stock ipykernel, interleaved (issue #20).

On a shared 2-core machine at load 10-40 the CPU *time* a kernel spends per cell moves
by 30% from one block to the next; the instructions it retires barely move, so an A/B
of a change to the kernel reads from them. Each kernel runs on the host (no container:
the code per cell is the same) as ``kernelhub_kernel.launch`` or ``ipykernel_launcher``,
driven by jupyter_client; ``perf stat -p`` attaches for a block of cells and counts every
thread of the kernel, user and kernel mode. The contenders take turns, in a rotating
order, block after block; medians [min-max] over blocks.

    PYTHONPATH=$PWD python bench/kernel_cpu.py --before /work/main/kernel-image
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

HERE = Path(__file__).resolve().parents[1] / "kernel-image"


class Kernel:
    def __init__(self, name: str, image_dir: Path | None, root: Path) -> None:
        self.name, self.image_dir, self.root = name, image_dir, root / name
        self.samples: dict[str, list[float]] = {"instructions": [], "task-clock": []}

    async def start(self) -> None:
        spec_dir = self.root / "kernels" / "k"
        spec_dir.mkdir(parents=True)
        module = "ipykernel_launcher" if self.image_dir is None else "kernelhub_kernel.launch"
        spec = KernelSpec(
            argv=[sys.executable, "-m", module, "-f", "{connection_file}"],
            display_name=self.name,
            language="python",
        )
        (spec_dir / "kernel.json").write_text(spec.to_json())
        env = {k: v for k, v in os.environ.items() if k != "IPYTHONDIR"}
        (self.root / "home").mkdir()
        (self.root / "state").mkdir()
        env.update(HOME=str(self.root / "home"), KERNELHUB_SNAPSHOTS=str(self.root / "state"))
        env["IPYTHONDIR"] = str(self.root / "ipython")
        if self.image_dir is not None:
            env["PYTHONPATH"] = str(self.image_dir)
        ksm = KernelSpecManager(kernel_dirs=[str(self.root / "kernels")])
        self.km = AsyncKernelManager(kernel_spec_manager=ksm, kernel_name="k")
        self.km.connection_file = str(self.root / "kernel.json")
        await self.km.start_kernel(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=60)
        for _ in range(50):  # warm-up
            await self.cell()

    @property
    def pid(self) -> int:
        pid: int = self.km.provisioner.process.pid  # type: ignore[union-attr]
        return pid

    async def cell(self) -> None:
        msg_id = self.kc.execute("1+1")
        idle = reply = False
        while not idle:
            msg: dict[str, Any] = await self.kc.get_iopub_msg(timeout=30)
            idle = (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            )
        while not reply:
            msg = await self.kc.get_shell_msg(timeout=30)
            reply = msg["parent_header"].get("msg_id") == msg_id

    async def block(self, cells: int) -> None:
        out = self.root / "perf.txt"
        out.unlink(missing_ok=True)
        perf = subprocess.Popen(  # noqa: ASYNC220 (started and stopped around the block)
            ["perf", "stat", "-x,", "-e", "instructions,task-clock", "-p", str(self.pid),
             "-o", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(100):  # perf opens its output once it has attached
            await asyncio.sleep(0.05)
            if out.exists():
                break
        await asyncio.sleep(0.1)
        for _ in range(cells):
            await self.cell()
        perf.send_signal(signal.SIGINT)
        perf.wait(30)
        if not out.exists():
            raise RuntimeError(f"perf stat -p {self.pid} wrote nothing (is perf usable here?)")
        for line in out.read_text().splitlines():
            fields = line.split(",")
            if len(fields) > 2 and fields[2] in self.samples and fields[0][:1].isdigit():
                # No hardware counters in some VMs: instructions then say <not supported>.
                self.samples[fields[2]].append(float(fields[0]) / cells)

    async def stop(self) -> None:
        self.kc.stop_channels()
        await self.km.shutdown_kernel(now=True)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the old kernel-image dir")
    parser.add_argument("--cells", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=7)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kh-kcpu-", dir="/tmp"))
    kernels = [
        Kernel("after", HERE, root),
        Kernel("before", args.before.resolve(), root),
        Kernel("stock", None, root),
    ]
    for k in kernels:
        await k.start()
    try:
        for i in range(args.blocks):
            order = kernels[i % 3 :] + kernels[: i % 3]
            for k in order if i % 2 == 0 else reversed(order):
                await k.block(args.cells)
    finally:
        for k in kernels:
            await k.stop()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end;"
          f" {args.cells} cells a block, {args.blocks} blocks; median [min-max] per cell")  # fmt: skip
    for k in kernels:
        ins, clock = k.samples["instructions"], k.samples["task-clock"]
        counted = (
            f"instructions {statistics.median(ins) / 1e6:7.3f} M"
            f" [{min(ins) / 1e6:.3f}-{max(ins) / 1e6:.3f}]   "
            if ins
            else ""
        )
        print(
            f"  {k.name:7} {counted}task-clock {statistics.median(clock):6.3f} ms"
            f" [{min(clock):.3f}-{max(clock):.3f}]"
        )
    for k in kernels[1:]:
        pairs = zip(kernels[0].samples["task-clock"], k.samples["task-clock"], strict=True)
        ratios = [a / b for a, b in pairs]
        print(
            f"  after/{k.name} task-clock, block by block: {statistics.median(ratios):.3f}"
            f" [{min(ratios):.3f}-{max(ratios):.3f}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
