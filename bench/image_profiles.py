"""The image profiles side by side: size, cold start, and the first import of the stack.

    python bench/image_profiles.py [--slim kernelhub/kernel:p1]
        [--data-science kernelhub/kernel:data-science] [--runs 5]

For each image: its size (``docker image inspect``), the cold start (create to a ready
kernel, ``KernelSession.start`` on the Docker backend, no warm pool: the number a session
waits for without one) and, in a fresh kernel, the time of the first ``import`` of what an
analyst loads (pandas + matplotlib in both; scipy, sklearn, polars, duckdb in the
data-science image). Medians over ``--runs``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import docker

from kernelhub.config import Limits
from kernelhub.execution.engine import KernelSession
from kernelhub.models import ExecutionStatus
from kernelhub.sandbox.base import SandboxSpec
from kernelhub.sandbox.docker import DockerBackend

COMMON = "import pandas, matplotlib.pyplot"
STACK = COMMON + ", scipy.stats, sklearn.linear_model, polars, duckdb, statsmodels.api"


async def measure(image: str, runs: int, imports: str) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(prefix="khb-", dir="/tmp"))
    backend = DockerBackend(image=image, run_dir=run_dir, instance=f"bench{uuid.uuid4().hex[:6]}")
    starts, loads = [], []
    try:
        for _ in range(runs):
            spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], limits=Limits())
            t0 = time.perf_counter()
            session = await KernelSession.start(backend, spec)
            starts.append(time.perf_counter() - t0)
            try:
                t0 = time.perf_counter()
                result = await session.execute(imports)
                loads.append(time.perf_counter() - t0)
                assert result.status == ExecutionStatus.COMPLETED, result.record
            finally:
                await session.close()
    finally:
        await backend.close()
    client = docker.from_env()
    try:
        size = client.images.get(image).attrs["Size"]
    finally:
        client.close()
    return {
        "size_mib": size / 2**20,
        "cold_start_s": statistics.median(starts),
        "first_import_s": statistics.median(loads),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slim", default="kernelhub/kernel:p1")
    parser.add_argument("--data-science", default="kernelhub/kernel:data-science")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rows = [
        ("slim", args.slim, COMMON),
        ("data-science", args.data_science, COMMON),
        ("data-science, full stack", args.data_science, STACK),
    ]
    for name, image, imports in rows:
        r = await measure(image, args.runs, imports)
        print(
            f"{name:26} {r['size_mib']:6.0f} MiB   cold start {r['cold_start_s']:.2f} s   "
            f"first import {r['first_import_s']:.2f} s   ({imports})"
        )


if __name__ == "__main__":
    asyncio.run(main())
