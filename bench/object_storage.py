"""Object storage numbers for docs/scale-out.md's arithmetic (issue #24): the bytes one
hibernated session takes in the bucket (a typical small namespace, and one holding
100 MiB), and the time to upload and download a 100 MiB blob.

    python bench/object_storage.py [--runs 3]

The server is the tests' ``rclone serve s3`` on loopback (tests/objects.py) over a local
directory: the times are kernelhub's side of the transfer (boto3, a multipart upload in
16 MiB parts, the download hashed and MAC-checked as it arrives) with no network in the
way, a floor for a real bucket, not a prediction of one. The sizes are what they are
anywhere. The sessions run on a gateway of its own (real Docker sandboxes) with
``KERNELHUB_GATEWAY__HIBERNATE_AFTER=2``; beside each hibernated session's bytes in the
bucket, what its node still holds for it (the state directory: the capture a wake on the
same node restores from, and the checkpoints for rewind).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway import Gateway, create_session
from report import MiB

from kernelhub.config import load_settings
from kernelhub.snapshot.blobs import blob_store
from tests.objects import S3Server

SMALL = """\
import json, math, re
import numpy as np
import pandas as pd
rows = [{"id": i, "name": f"item {i}", "score": math.sqrt(i)} for i in range(1000)]
df = pd.DataFrame(rows)
weights = np.linspace(0, 1, 10_000)
config = {"model": "x", "threshold": 0.5, "tags": ["a", "b", "c"]}
notes = "some text " * 200
"""
BIG = "import numpy as np\nbig = np.random.default_rng(0).random(100 * 2**20 // 8)"


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), MiB):
        yield data[i : i + MiB]


async def transfer_times(s3: S3Server, root: Path, runs: int) -> dict[str, list[float]]:
    settings = load_settings(
        data_dir=root / "node",
        objects=s3.settings(s3.fresh_bucket()),
        cluster={"snapshot_key_file": root / "cluster.key"},
    )
    a = blob_store(settings)
    b = blob_store(settings.model_copy(update={"data_dir": root / "other"}))
    data = os.urandom(100 * MiB)
    out: dict[str, list[float]] = {"upload": [], "download": []}
    for run in range(runs):
        sid = f"bench{run}"
        _, sha256 = await a.write(sid, _chunks(data), 1 << 31)
        t0 = time.perf_counter()
        await a.commit(sid)
        out["upload"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await b.fetch(sid, "me", sha256, a.mac(sid, "me", sha256), 1 << 31)
        out["download"].append(time.perf_counter() - t0)
        await a.delete(sid)
        b.remove(sid)
    return out


def tree_bytes(path: Path) -> int:
    """Bytes under ``path``, each hard-linked file once (checkpoints share files)."""
    seen: dict[int, int] = {}
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            seen[st.st_ino] = st.st_size
    return sum(seen.values())


async def hibernated(s3: S3Server, root: Path, *, keep_state: bool) -> dict[str, float]:
    """Bytes per hibernated session (bucket, node) and the next execute's time (its wake:
    a cold start without standby, the restore, the cell), under one gateway's settings."""
    bucket = s3.fresh_bucket()
    instance = f"bobj-{uuid.uuid4().hex[:6]}"
    run_dir = Path(f"/tmp/{instance}")
    gw = await Gateway.launch(
        root / instance,
        instance=instance,
        env={
            "KERNELHUB_RUN_DIR": str(run_dir),
            "KERNELHUB_GATEWAY__HIBERNATE_AFTER": "2",
            "KERNELHUB_GATEWAY__HIBERNATE_STANDBY": "false",
            "KERNELHUB_GATEWAY__HIBERNATE_KEEP_STATE": str(keep_state).lower(),
            "KERNELHUB_POOL__SIZE": "0",
            "KERNELHUB_CLUSTER__SNAPSHOT_KEY_FILE": str(root / "cluster.key"),
            **s3.env(bucket),
        },
    )
    out: dict[str, float] = {}
    try:
        async with gw.client() as http:
            for name, code in (("small namespace", SMALL), ("100 MiB namespace", BIG)):
                sid = await create_session(http, {"limits": {"memory_bytes": 1024 * MiB}})
                r = await http.post(
                    f"/v1/sessions/{sid}/executions", json={"code": code, "wait": True}
                )
                assert r.json()["record"]["status"] == "completed", r.text
                deadline = time.monotonic() + 120
                while (await http.get(f"/v1/sessions/{sid}")).json()["state"] != "hibernated":
                    assert time.monotonic() < deadline, "never hibernated"
                    await asyncio.sleep(0.2)
                out[f"{name}: bytes in the bucket"] = sum(s3.keys(bucket).values())
                # What its node still holds: the kept capture (the fast wake) and the
                # checkpoints (rewind), in the state directory, a tmpfs: host memory.
                state = run_dir / instance / f"{sid}.state"
                out[f"{name}: bytes on its node"] = tree_bytes(state) if state.exists() else 0
                t0 = time.perf_counter()
                r = await http.post(
                    f"/v1/sessions/{sid}/executions", json={"code": "1 + 1", "wait": True}
                )
                out[f"{name}: next execute (wakes it), s"] = time.perf_counter() - t0
                assert r.json()["record"]["status"] == "completed", r.text
                await http.delete(f"/v1/sessions/{sid}")
    finally:
        await gw.stop()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    s3 = S3Server()
    s3.start()
    try:
        with tempfile.TemporaryDirectory(prefix="kh-bench-objects-") as tmp:
            root = Path(tmp)
            (root / "cluster.key").write_bytes(os.urandom(32))
            times = await transfer_times(s3, root, args.runs)
            kept = await hibernated(s3, root, keep_state=True)
            dropped = await hibernated(s3, root, keep_state=False)
    finally:
        s3.stop()
    for what, values in times.items():
        median = statistics.median(values)
        print(f"{what} of a 100 MiB blob: {median:.3f} s median of {len(values)} "
              f"({100 / median:.0f} MiB/s; runs {', '.join(f'{v:.3f}' for v in values)})")  # fmt: skip
    for label, numbers in (("default (state kept)", kept), ("HIBERNATE_KEEP_STATE=false", dropped)):
        for what, value in numbers.items():
            shown = (
                f"{value:.2f}" if what.endswith(", s") else f"{value:.0f} ({value / MiB:.2f} MiB)"
            )
            print(f"one hibernated session, {label}, {what}: {shown}")


if __name__ == "__main__":
    asyncio.run(main())
