"""The measurements behind docs/scale-out.md: what one session costs a node in memory, what
a hibernated session costs in object storage, and what one cell costs PostgreSQL.

One ``kernelhub serve`` (Docker backend, no warm pool) on a private PostgreSQL server
(tests/postgres.py: unix socket only, fsync off), on this machine's Docker daemon:

- memory: the gateway's RSS before and after ``--sessions`` idle sessions (each ran one
  ``1+1``), each sandbox's cgroup memory (as ``docker stats``) and PSS, the RSS of each
  sandbox's containerd shim; then one session after a pandas workload;
- blobs: ``size_bytes`` of a snapshot of a few typical small namespaces (a hibernation
  stores the same capture);
- store: ``pg_stat_database`` (``xact_commit``, ``tup_inserted`` and ``tup_updated``) and
  WAL bytes before and after ``--cells`` sequential cells on one session, with checkpoints
  on (the default, every cell) and off, less what the idle gateway writes over as long.

    python bench/scaleout.py [--sessions 8] [--cells 100]   # prints a JSON report
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker
import httpx
import psutil
from gateway import Gateway, create_session, delete_session, rest_roundtrip
from memory import container_pss, container_usage, process_memory

from kernelhub.sandbox.base import LABEL_INSTANCE, LABEL_SESSION
from tests.postgres import PostgresCluster, problem

INSTANCE = "scaleout"
# pg_stat counters reach shared memory when a backend flushes them: at most once a second
# while busy, and an idle backend within 10 s (PGSTAT_IDLE_INTERVAL in PostgreSQL 15).
STATS_FLUSH = 11.0
WORKLOAD = (
    "import numpy as np, pandas as pd\n"
    "df = pd.DataFrame(np.random.default_rng(0).random((200_000, 8)), columns=list('abcdefgh'))\n"
    "summary = df.describe()\n"
    "df['k'] = (df.a * 10).astype(int)\n"
    "g = df.groupby('k').mean()\n"
)
NAMESPACES = {
    "empty (a fresh session)": "",
    "a few scalars, a 1,000-item list and dict, a 10 kB string": (
        "a = 1\nb = 2.5\nitems = list(range(1000))\nindex = {str(i): i for i in range(1000)}\n"
        "text = 'x' * 10_000\n"
    ),
    "a 10,000-row × 5-column DataFrame": (
        "import numpy as np, pandas as pd\n"
        "df = pd.DataFrame(np.random.default_rng(0).random((10_000, 5)), columns=list('abcde'))\n"
    ),
    "an 8 MB numpy array (10**6 float64)": (
        "import numpy as np\nx = np.random.default_rng(0).random(10**6)\n"
    ),
}


def mib(n: float) -> float:
    return round(n / 2**20, 1)


def pg_counters(url: str) -> dict[str, int]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted,"
            " pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint"
            " FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    keys = ("xact_commit", "tup_inserted", "tup_updated", "tup_deleted", "wal_bytes")
    return dict(zip(keys, (int(v) for v in row), strict=True))


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


async def measured(url: str, run: Any) -> tuple[dict[str, int], float]:
    """Counter deltas over ``await run()`` (stats flushed before and after) and its seconds."""
    await asyncio.sleep(STATS_FLUSH)
    before = pg_counters(url)
    t0 = time.monotonic()
    await run()
    elapsed = time.monotonic() - t0
    await asyncio.sleep(STATS_FLUSH)
    return delta(pg_counters(url), before), elapsed + 2 * STATS_FLUSH


def session_container(client: docker.DockerClient, sid: str) -> Any:
    [container] = client.containers.list(
        filters={"label": [f"{LABEL_SESSION}={sid}", f"{LABEL_INSTANCE}={INSTANCE}"]}
    )
    return container


def shim_memory(container: Any) -> tuple[int, int | None]:
    """(RSS, PSS) of the containerd-shim that holds the sandbox's init process (one per
    container; its code is shared between shims, which PSS counts fairly)."""
    container.reload()
    parent = psutil.Process(int(container.attrs["State"]["Pid"])).parent()
    assert parent is not None and "shim" in parent.name(), parent
    return process_memory(parent.pid)


async def memory(gw: Gateway, http: httpx.AsyncClient, n: int) -> dict[str, Any]:
    client = docker.from_env()
    warm = await create_session(http)  # the first session loads code the rest share
    await rest_roundtrip(http, warm)
    await delete_session(http, warm)
    await asyncio.sleep(2)
    rss0 = gw.rss()
    sids: list[str] = []
    try:
        for _ in range(n):
            sids.append(await create_session(http))
            await rest_roundtrip(http, sids[-1])
        await asyncio.sleep(3)  # idle, start-up garbage collected
        rss_n = gw.rss()
        containers = [session_container(client, sid) for sid in sids]
        usage = [container_usage(c)[0] for c in containers]
        pss = [container_pss(c) for c in containers]
        shims = [shim_memory(c) for c in containers]
        await rest_roundtrip(http, sids[0], WORKLOAD)
        await asyncio.sleep(2)
        working, working_raw = container_usage(containers[0])
        working_pss = container_pss(containers[0])
    finally:
        for sid in sids:
            await delete_session(http, sid)
        client.close()
    return {
        "sessions": n,
        "gateway_rss_mib": {"before": mib(rss0), "after": mib(rss_n)},
        "gateway_rss_per_session_mib": mib((rss_n - rss0) / n),
        "idle_cgroup_mib_median": mib(statistics.median(usage)),
        "idle_cgroup_mib_range": [mib(min(usage)), mib(max(usage))],
        "idle_pss_mib_median": mib(statistics.median(p for p in pss if p is not None))
        if any(p is not None for p in pss)
        else None,
        "shim_rss_mib_median": mib(statistics.median(rss for rss, _ in shims)),
        "shim_pss_mib_median": mib(statistics.median(pss or 0 for _, pss in shims)),
        "working_cgroup_mib": mib(working),
        "working_cgroup_raw_mib": mib(working_raw),
        "working_pss_mib": mib(working_pss) if working_pss is not None else None,
        "workload": WORKLOAD,
    }


async def blobs(http: httpx.AsyncClient) -> dict[str, int]:
    sizes = {}
    for name, code in NAMESPACES.items():
        sid = await create_session(http, {"checkpoints": "off"})
        try:
            if code:
                await rest_roundtrip(http, sid, code)
            r = await http.post(f"/v1/sessions/{sid}/snapshots")
            assert r.status_code in (200, 201), r.text
            sizes[name] = int(r.json()["size_bytes"])
        finally:
            await delete_session(http, sid)
    return sizes


async def store_writes(http: httpx.AsyncClient, url: str, cells: int) -> dict[str, Any]:
    async def idle() -> None:
        await asyncio.sleep(30)

    idle_delta, idle_seconds = await measured(url, idle)
    report: dict[str, Any] = {
        "idle_per_second": {k: round(v / idle_seconds, 2) for k, v in idle_delta.items()}
    }
    for label, body, code in (
        ("checkpoints every cell, print(i)", {}, "print({i})"),
        ("checkpoints off, print(i)", {"checkpoints": "off"}, "print({i})"),
        ("checkpoints off, x = i (no output)", {"checkpoints": "off"}, "x = {i}"),
        (
            "checkpoints off, 20 prints 10 ms apart (streamed output)",
            {"checkpoints": "off"},
            "import time\nfor j in range(20):\n    print({i}, j, flush=True); time.sleep(0.01)",
        ),
    ):
        sid = await create_session(http, body)
        await rest_roundtrip(http, sid)
        try:

            async def run(sid: str = sid, code: str = code) -> None:
                for i in range(cells):
                    await rest_roundtrip(http, sid, code.format(i=i))

            raw, seconds = await measured(url, run)
        finally:
            await delete_session(http, sid)
        net = {k: v - idle_delta[k] * seconds / idle_seconds for k, v in raw.items()}
        report[label] = {
            "cells": cells,
            "per_cell": {k: round(v / cells, 2) for k, v in net.items()},
        }
    return report


async def leases(url: str, sessions: int, rounds: int = 10) -> dict[str, Any]:
    """A heartbeat's lease renewal (``Store.renew_leases``: one UPDATE of every live
    session row of the node) with ``sessions`` rows on one node, most of them hibernated:
    seconds, rows and WAL per renewal."""
    from datetime import UTC, datetime, timedelta

    from kernelhub.store.postgres import PostgresStore
    from kernelhub.store.records import StoredSession

    store = await PostgresStore.open(url, node="n1")
    try:
        now = datetime.now(UTC)
        for i in range(sessions):
            row = StoredSession(
                id=f"s{i:06d}", owner="bench", backend="docker",
                state="hibernated" if i % 30 else "ready", created_at=now,
                limits={"memory_bytes": 512 * 2**20}, metadata={"task": "bench"},
                reason=None, deleted_at=None, hibernation=f"hib-{i:012d}",
            )  # fmt: skip
            await store.insert_session(row)
        times = []

        async def renew() -> None:
            for r in range(rounds):
                t0 = time.perf_counter()
                renewed = await store.renew_leases("n1", now + timedelta(seconds=10 + r))
                times.append(time.perf_counter() - t0)
                assert renewed == sessions, renewed

        counted, _ = await measured(url, renew)
    finally:
        await store.close()
    return {
        "sessions": sessions,
        "renewal_seconds_median": round(statistics.median(times), 4),
        "per_renewal": {k: round(v / rounds) for k, v in counted.items()},
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--leases", type=int, default=10_000, help="session rows on one node")
    args = parser.parse_args()
    if (why := problem()) is not None:
        raise SystemExit(f"no PostgreSQL here: {why}")
    pg = PostgresCluster()
    pg.start()
    url = pg.fresh_url()
    root = Path(tempfile.mkdtemp(prefix="kh-scaleout-"))
    gw = await Gateway.launch(
        root,
        instance=INSTANCE,
        env={
            "KERNELHUB_STORE__URL": url,
            "KERNELHUB_RUN_DIR": "/run/kh-scaleout",
            "KERNELHUB_POOL__SIZE": "0",
            "KERNELHUB_GATEWAY__MAX_SESSIONS": str(args.sessions + 8),
            "KERNELHUB_GATEWAY__MAX_SESSIONS_PER_PRINCIPAL": str(args.sessions + 8),
        },
    )
    try:
        async with gw.client() as http:
            report = {
                "memory": await memory(gw, http, args.sessions),
                "snapshot_bytes": await blobs(http),
                "store": await store_writes(http, pg.url, args.cells),
            }
        report["leases"] = await leases(pg.fresh_url(), args.leases)
    finally:
        await gw.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
