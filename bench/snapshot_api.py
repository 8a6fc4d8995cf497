"""Snapshots through the API against the fastest honest way to do the same work.

    python bench/snapshot_api.py [--sizes 10,100,500] [--rounds 3] [--out FILE]

One gateway of its own (``bench.gateway.Gateway``, real Docker sandboxes). For each size,
a session holds a numeric namespace of that many MiB (four float64 arrays and a small
dict). Per round, interleaved so that noise hits all of them alike:

- **snapshot**: ``POST /v1/sessions/{id}/snapshots``, timed at the client (the kernel's
  capture, the stream out of the sandbox, the host's hash and write, the store);
- its **floor**, ``pickle.dump(protocol=5)`` of the same objects (one dict) to a file in
  the same sandbox (its /workspace, a tmpfs: faster than the host's disk our blobs go
  to), timed in the kernel; ``dill.dump`` of the same beside it;
- **restore minus a cold start**: the ``restore.duration`` of the ``POST /v1/sessions``
  with ``from_snapshot`` (the gateway's own timing of the restore in that request: the
  blob streamed in and hashed, the kernel's load, from the sandbox being up to the report),
  and beside it the median of that request less the median plain ``POST /v1/sessions``
  (one of each per round; a cold start alone varies by more than a restore, on a shared
  machine by more than the restore takes, so that difference is only a cross-check);
- its floor, ``pickle.load`` of that file in the same sandbox; ``dill.load`` beside it.

Reported: median and spread (min–max) of the rounds; ratios are the median of the rounds'
own ratios [their range]. Targets (issue 19): snapshot ≤ 1.5×
``pickle.dump``; restore minus a cold start ≤ 2× ``pickle.load`` + 0.3 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from gateway import Gateway, create_session, create_timed, delete_session
from report import Row, seconds

MiB = 2**20
LIMITS = {"memory_bytes": 3 * 1024 * MiB, "disk_bytes": 1536 * MiB, "cell_timeout": 600}

FLOOR_CELL = """
import pickle, time, dill, os
_objs = {{name: globals()[name] for name in {names!r}}}
_t = time.perf_counter()
with open('/workspace/.floor.pkl', 'wb') as _f:
    pickle.dump(_objs, _f, protocol=5)
_dump = time.perf_counter() - _t
_t = time.perf_counter()
with open('/workspace/.floor.pkl', 'rb') as _f:
    _back = pickle.load(_f)
_load = time.perf_counter() - _t
del _back
os.remove('/workspace/.floor.pkl')
_t = time.perf_counter()
with open('/workspace/.floor.dill', 'wb') as _f:
    dill.dump(_objs, _f, protocol=5)
_ddump = time.perf_counter() - _t
_t = time.perf_counter()
with open('/workspace/.floor.dill', 'rb') as _f:
    _back = dill.load(_f)
_dload = time.perf_counter() - _t
del _back, _objs
os.remove('/workspace/.floor.dill')
print(__import__('json').dumps({{'dump': _dump, 'load': _load, 'dill_dump': _ddump, 'dill_load': _dload}}))
"""

NAMES = ["a", "b", "c", "d", "params"]


def namespace_cell(mib: int) -> str:
    n = mib * MiB // 8 // 4
    return (
        "import numpy as np\n"
        "rng = np.random.default_rng(0)\n"
        + "".join(f"{v} = rng.random({n})\n" for v in "abcd")
        + "params = {'alpha': 0.5, 'names': [str(i) for i in range(100)]}\n"
    )


@dataclass
class Samples:
    mib: int
    rounds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.rounds.setdefault(name, []).append(value)

    def median(self, name: str) -> float:
        return statistics.median(self.rounds[name])

    def ratio(self, name: str, floor: str) -> str:
        """The median of the rounds' own ratios [their range]: each round's contenders
        saw the same moment of a shared machine."""
        ratios = [a / b for a, b in zip(self.rounds[name], self.rounds[floor], strict=True)]
        return f"{statistics.median(ratios):.2f}× [{min(ratios):.2f}–{max(ratios):.2f}]"

    def spread(self, name: str) -> str:
        values = self.rounds[name]
        return f"{seconds(min(values))}–{seconds(max(values))}"


async def run_cell(http: httpx.AsyncClient, sid: str, code: str) -> dict[str, Any]:
    r = await http.post(
        f"/v1/sessions/{sid}/executions", json={"code": code, "wait": True, "timeout": 600}
    )
    body: dict[str, Any] = r.json()
    if r.status_code != 200 or body.get("status") != "completed":
        raise RuntimeError(f"cell failed: {r.status_code} {r.text[:2000]}")
    return body


def stdout_of(body: dict[str, Any]) -> str:
    events = body.get("events", [])
    return "".join(e["text"] for e in events if e["type"] == "stream" and e["name"] == "stdout")


async def one_size(http: httpx.AsyncClient, mib: int, rounds: int) -> Samples:
    samples = Samples(mib)
    sid = await create_session(http, {"limits": LIMITS})
    try:
        await run_cell(http, sid, namespace_cell(mib))
        for _ in range(rounds):
            t0 = time.perf_counter()
            r = await http.post(f"/v1/sessions/{sid}/snapshots")
            samples.add("snapshot", time.perf_counter() - t0)
            if r.status_code != 201:
                raise RuntimeError(f"snapshot: {r.status_code} {r.text}")
            snap = r.json()
            # Where the time went (the API's own spans), kept as samples of their own.
            for key, value in snap.get("host_timings", {}).items():
                if isinstance(value, (int, float)):
                    samples.add(f"host.{key}", float(value))
            for key, value in snap.get("kernel_timings", {}).items():
                samples.add(f"kernel.{key}", float(value))
            floors = json.loads(
                stdout_of(await run_cell(http, sid, FLOOR_CELL.format(names=NAMES)))
            )
            for key, value in floors.items():
                samples.add(key, value)
            cold, plain = await create_timed(http, {"limits": LIMITS})
            await delete_session(http, plain["id"])
            warm, restored = await create_timed(
                http, {"limits": LIMITS, "from_snapshot": snap["id"]}
            )
            if restored.get("restore", {}).get("failed"):
                raise RuntimeError(f"restore lost variables: {restored['restore']['failed']}")
            await delete_session(http, restored["id"])
            samples.add("cold", cold)
            samples.add("restore_total", warm)
            samples.add("restore", float(restored["restore"]["duration"]))
            await http.delete(f"/v1/snapshots/{snap['id']}")
    finally:
        await delete_session(http, sid)
    return samples


async def measure(sizes: list[int], rounds: int, data: Path | None = None) -> list[Samples]:
    root = Path(tempfile.mkdtemp(prefix="khsnap")) if data is None else data
    root.mkdir(parents=True, exist_ok=True)
    gw = await Gateway.launch(
        root,
        instance=f"kbs{uuid.uuid4().hex[:6]}",
        env={
            "KERNELHUB_POOL__SIZE": "0",
            "KERNELHUB_GATEWAY__SNAPSHOT_TIMEOUT": "600",
        },
    )
    try:
        async with gw.client() as http:
            return [await one_size(http, mib, rounds) for mib in sizes]
    finally:
        await gw.stop()


def rows(results: list[Samples], section: str = "snapshot") -> list[Row]:
    out: list[Row] = []
    for s in results:
        snap, dump, load = s.median("snapshot"), s.median("dump"), s.median("load")
        restore = s.median("restore")
        difference = s.median("restore_total") - s.median("cold")
        n = len(s.rounds["snapshot"])
        out += [
            Row(section, f"{s.mib} MiB numeric: API snapshot (median of {n}; spread {s.spread('snapshot')})",
                seconds(snap), f"{seconds(dump)} pickle.dump(protocol=5); dill {seconds(s.median('dill_dump'))}",
                s.ratio("snapshot", "dump"), "≤ 1.5×"),
            Row(section, f"{s.mib} MiB numeric: API restore minus a cold start (spread {s.spread('restore')};"
                f" cross-check, create from the snapshot less a plain create: {seconds(difference)})",
                seconds(restore), f"{seconds(load)} pickle.load; dill {seconds(s.median('dill_load'))}",
                f"{s.ratio('restore', 'load')}; {restore - 2 * load:+.2f} s over 2×",
                f"≤ {seconds(2 * load + 0.3)} (2× + 0.3 s)"),
        ]  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,500", help="MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write JSON samples here")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    results = asyncio.run(measure(sizes, max(args.rounds, 1)))
    for row in rows(results):
        print(
            f"{row.measurement}: {row.value} | floor {row.floor} | {row.ratio} | target {row.target}"
        )
    for s in results:
        spans = sorted(k for k in s.rounds if k.startswith(("host.", "kernel.")))
        print(
            f"{s.mib} MiB breakdown, ms (median): "
            + ", ".join(f"{k} {1000 * s.median(k):.1f}" for k in spans)
        )
    if args.out:
        args.out.write_text(json.dumps([{"mib": s.mib, **s.rounds} for s in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
