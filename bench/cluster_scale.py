"""Many sessions created and hibernated across three node agents (issue #24's benchmark):
what one session costs the shared store and the bucket, and how long each step takes.

    python bench/cluster_scale.py [--sessions 1000] [--concurrency 24] [--wake 20]
                                  [--out result.md] [--json result.json]

Run from a checkout with the repository root on PYTHONPATH. It starts the multinode
tier's cluster (``tests/multinode/conftest.py``: a private PostgreSQL, 3 node agents on
127.0.0.2-4 on the Docker backend, 2 gateway replicas) with the snapshots in a real
``rclone serve s3`` bucket (``tests/objects.py``) under one cluster-wide MAC key, the pool
off, ``HIBERNATE_KEEP_STATE=false`` and ``HIBERNATE_STANDBY=false`` (a hibernated session
holds nothing on its node) and ``HIBERNATE_AFTER=1``: the nodes' own idle timer
hibernates each session (there is no hibernate route).

Each session, through the replicas in turn: ``POST /v1/sessions``, one cell that leaves
state (``x = list(range(1000))``), then it waits for the timer to hibernate it. At most
``--concurrency`` sessions are between their create and their hibernation at once, so only
that many sandboxes run. The hibernation time is from the cell's answer to the store
saying ``hibernated`` (polled every 0.2 s): it includes the 1 s idle wait and the timer's
0.5 s tick. Then ``--wake`` sessions, spread over the run, each get one cell through the
other replica that checks ``x`` came back; with ``RELEASE_HIBERNATED`` (the default) they
wake wherever placement puts them.

Every sandbox carries its node's instance label and is removed at the end, as in the
tests; the servers and their directories go too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from report import quantile

from tests import postgres
from tests.multinode.conftest import HEARTBEAT, Cluster
from tests.objects import S3Server
from tests.objects import problem as objects_problem

CELL = "x = list(range(1000))"
CHECK = "assert x == list(range(1000)), 'x did not come back'\nlen(x)"
HIBERNATE_AFTER = 1.0
POLL = 0.2


@dataclass
class Session:
    index: int
    id: str = ""
    replica: int = 0
    create: float = 0.0
    cell: float = 0.0
    cell_done: float = 0.0
    hibernate: float = 0.0
    node: str | None = None
    woke_on: str | None = None
    wake: float | None = None
    error: str | None = None


@dataclass
class Watch:
    """The sessions table, read every ``POLL`` seconds by one task for all sessions: where
    each one runs, and when the store first said it hibernated."""

    url: str
    nodes: dict[str, str] = field(default_factory=dict)
    hibernated: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, asyncio.Event] = field(default_factory=dict)

    async def run(self) -> None:
        import psycopg

        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            while True:
                rows = await (await conn.execute("SELECT id, state, node FROM sessions")).fetchall()
                now = time.perf_counter()
                for sid, state, node in rows:
                    if node:
                        self.nodes[sid] = node
                    if state == "hibernated" and sid not in self.hibernated:
                        self.hibernated[sid] = now
                        if (event := self.waiting.get(sid)) is not None:
                            event.set()
                await asyncio.sleep(POLL)

    async def until_hibernated(self, sid: str, timeout: float) -> float:
        event = self.waiting.setdefault(sid, asyncio.Event())
        if sid not in self.hibernated:
            await asyncio.wait_for(event.wait(), timeout)
        return self.hibernated[sid]


def percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    return {
        "p50": statistics.median(samples),
        "p90": quantile(samples, 0.9),
        "p99": quantile(samples, 0.99),
        "max": max(samples),
        "mean": statistics.fmean(samples),
    }


async def executed(http: httpx.AsyncClient, sid: str, code: str) -> float:
    t0 = time.perf_counter()
    r = await http.post(
        f"/v1/sessions/{sid}/executions", json={"code": code, "wait": True}, timeout=600
    )
    elapsed = time.perf_counter() - t0
    if r.status_code != 200 or r.json()["status"] != "completed":
        raise RuntimeError(f"execute in {sid}: {r.status_code} {r.text[:500]}")
    return elapsed


async def one(
    s: Session,
    clients: list[httpx.AsyncClient],
    watch: Watch,
    slots: asyncio.Semaphore,
    deadline: float,
) -> None:
    async with slots:
        if time.perf_counter() > deadline:
            s.error = "not started: past --timebox"
            return
        http = clients[s.replica]
        try:
            t0 = time.perf_counter()
            r = await http.post("/v1/sessions", json={}, timeout=600)
            s.create = time.perf_counter() - t0
            if r.status_code != 201:
                raise RuntimeError(f"POST /v1/sessions: {r.status_code} {r.text[:500]}")
            s.id = r.json()["id"]
            s.cell = await executed(http, s.id, CELL)
            s.cell_done = time.perf_counter()
            s.hibernate = await watch.until_hibernated(s.id, 600) - s.cell_done
            s.node = watch.nodes.get(s.id)
        except Exception as exc:  # one session's failure is a number in the report
            s.error = f"{type(exc).__name__}: {exc}"


def schema_of(url: str) -> str:
    found = re.search(r"search_path%3D(\w+)", url)
    assert found, url
    return found.group(1)


async def database_size(pg: postgres.PostgresCluster) -> int:
    import psycopg

    async with await psycopg.AsyncConnection.connect(pg.url, autocommit=True) as conn:
        row = await (await conn.execute("SELECT pg_database_size(current_database())")).fetchone()
    assert row is not None
    return int(row[0])


async def store_sizes(pg: postgres.PostgresCluster, url: str) -> dict[str, Any]:
    import psycopg

    schema = schema_of(url)
    async with await psycopg.AsyncConnection.connect(pg.url, autocommit=True) as conn:
        rows = await (
            await conn.execute(
                "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relkind = 'r' ORDER BY 2 DESC",
                (schema,),
            )
        ).fetchall()
        tables: dict[str, dict[str, int]] = {}
        for name, size in rows:
            (count,) = await (
                await conn.execute(f'SELECT count(*) FROM {schema}."{name}"')
            ).fetchone()  # type: ignore[misc]
            tables[name] = {"bytes": int(size), "rows": int(count)}
        (released,) = await (  # type: ignore[misc]
            await conn.execute(
                f"SELECT count(*) FROM {schema}.sessions"
                " WHERE state = 'hibernated' AND node IS NULL"
            )
        ).fetchone()
        snaps = await (
            await conn.execute(f"SELECT size, metadata FROM {schema}.snapshots")
        ).fetchall()
    durations = []
    kinds: dict[str, dict[str, int]] = {}
    for size, meta in snaps:
        m = json.loads(meta)
        kind = kinds.setdefault(str(m.get("kind")), {"count": 0, "bytes": 0})
        kind["count"] += 1
        kind["bytes"] += int(size)
        if m.get("kind") == "hibernation" and isinstance(m.get("duration"), (int, float)):
            durations.append(float(m["duration"]))
    return {
        "database_bytes": await database_size(pg),
        "snapshot_kinds": kinds,
        "hibernated_without_a_node": int(released),
        "tables": tables,
        "snapshot_rows": len(snaps),
        "snapshot_bytes": sum(int(size) for size, _ in snaps),
        "capture_seconds": percentiles(durations),
    }


def bucket_sizes(s3: S3Server, bucket: str) -> dict[str, int]:
    count = total = 0
    for page in s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            count += 1
            total += int(obj["Size"])
    on_disk = sum(p.stat().st_size for p in (s3.data / bucket).rglob("*") if p.is_file())
    return {"objects": count, "bytes": total, "directory_bytes": on_disk}


async def wake_sample(
    sessions: list[Session], clients: list[httpx.AsyncClient], watch: Watch, n: int
) -> None:
    done = [s for s in sessions if s.error is None]
    step = max(1, len(done) // max(1, n))
    for s in done[::step][:n]:
        try:
            # Through the other replica than the one that made it.
            s.wake = await executed(clients[1 - s.replica], s.id, CHECK)
            await asyncio.sleep(2 * POLL)  # the watcher's next read names its node
            s.woke_on = watch.nodes.get(s.id)
        except Exception as exc:
            s.error = f"wake: {type(exc).__name__}: {exc}"


def load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


async def measure(
    n: int, concurrency: int, wakes: int, timebox: float, logs: Path | None
) -> dict[str, Any]:
    pg = postgres.PostgresCluster()
    pg.start()
    s3 = S3Server()
    s3.start()
    result: dict[str, Any] = {"sessions": n, "concurrency": concurrency}
    with tempfile.TemporaryDirectory(prefix="kh-bench-scale-") as tmp:
        root = Path(tmp)
        url = pg.fresh_url()
        bucket = s3.fresh_bucket()
        # The bucket and one cluster-wide key file, exports at the operator's default.
        cluster = Cluster(root / "cluster", url, objects=s3.env(bucket), export_interval=30)
        per_node = max(1, min(16, -(-concurrency // len(cluster.nodes))))
        extra = {
            "KERNELHUB_GATEWAY__HIBERNATE_AFTER": str(HIBERNATE_AFTER),
            "KERNELHUB_GATEWAY__HIBERNATE_CONCURRENCY": str(per_node),
            "KERNELHUB_GATEWAY__HIBERNATE_KEEP_STATE": "false",
            "KERNELHUB_GATEWAY__HIBERNATE_STANDBY": "false",
            "KERNELHUB_GATEWAY__MAX_SESSIONS": str(n + 100),
            "KERNELHUB_GATEWAY__MAX_SESSIONS_PER_PRINCIPAL": str(n + 100),
        }
        for proc in [*cluster.nodes, *cluster.replicas]:
            proc.env.update(extra)
        cluster.env.update(extra)
        result["settings"] = {k: v for k, v in extra.items() if "OBJECTS__" not in k}
        watcher: asyncio.Task[None] | None = None
        clients: list[httpx.AsyncClient] = []
        try:
            t0 = time.perf_counter()
            await asyncio.to_thread(cluster.start)
            result["cluster_start_seconds"] = time.perf_counter() - t0
            token = await asyncio.to_thread(cluster.token, "bench")
            auth = {"Authorization": f"Bearer {token}"}
            limits = httpx.Limits(max_connections=concurrency + 4)
            clients = [
                httpx.AsyncClient(base_url=r.url, headers=auth, limits=limits)
                for r in cluster.replicas
            ]
            result["database_bytes_empty"] = await database_size(pg)
            watch = Watch(url)
            watcher = asyncio.create_task(watch.run())
            sessions = [Session(i, replica=i % 2) for i in range(n)]
            slots = asyncio.Semaphore(concurrency)
            load_before = load_average()
            t0 = time.perf_counter()
            deadline = t0 + timebox
            await asyncio.gather(*(one(s, clients, watch, slots, deadline) for s in sessions))
            wall = time.perf_counter() - t0
            result["load_average"] = {"before": load_before, "after": load_average()}
            ok = [s for s in sessions if s.error is None]
            result["created_and_hibernated"] = len(ok)
            result["wall_seconds"] = wall
            result["per_node"] = dict(sorted(Counter(str(s.node) for s in ok).items()))
            result["create_seconds"] = percentiles([s.create for s in ok])
            result["cell_seconds"] = percentiles([s.cell for s in ok])
            result["hibernate_seconds"] = percentiles([s.hibernate for s in ok])
            # Each node gives up its hibernated sessions within a heartbeat (0.5 s here).
            await asyncio.sleep(3 * HEARTBEAT)
            result["store"] = await store_sizes(pg, url)
            result["bucket"] = await asyncio.to_thread(bucket_sizes, s3, bucket)
            await wake_sample(sessions, clients, watch, wakes)
            woken = [s for s in sessions if s.wake is not None]
            result["wake"] = {
                "sampled": len(woken),
                "seconds": percentiles([s.wake for s in woken if s.wake is not None]),
                "moved": sum(1 for s in woken if s.woke_on != s.node),
                "each": [
                    {
                        "session": s.id,
                        "hibernated_on": s.node,
                        "woke_on": s.woke_on,
                        "seconds": s.wake,
                    }
                    for s in woken
                ],
            }
            errors = [f"{s.index}: {s.error}" for s in sessions if s.error]
            result["errors"] = {"count": len(errors), "first": errors[:10]}
            return result
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            for c in clients:
                await c.aclose()
            if logs is not None:  # the processes' logs, before their directory goes
                logs.mkdir(parents=True, exist_ok=True)
                for log in (root / "cluster").rglob("*.log"):
                    shutil.copy(log, logs / f"{log.parent.name}-{log.name}")
            await asyncio.to_thread(cluster.stop)  # and every sandbox by its node's label
            s3.stop()
            pg.stop()


def _t(p: dict[str, float]) -> str:
    if not p:
        return "-"
    return " / ".join(f"{p[k]:.2f}" for k in ("p50", "p90", "p99", "max"))


def report(r: dict[str, Any]) -> str:
    n = r["created_and_hibernated"] or 1
    store, bucket = r["store"], r["bucket"]
    rows = [
        f"{r['created_and_hibernated']} of {r['sessions']} sessions created, run and hibernated "
        f"across {len(r['per_node'])} nodes, {r['concurrency']} at once, "
        f"in {r['wall_seconds']:.0f} s ({r['created_and_hibernated'] / r['wall_seconds']:.2f}/s); "
        f"load average before {r['load_average']['before']}, after {r['load_average']['after']}.",
        "",
        "| step | p50 / p90 / p99 / max (s) |",
        "|---|---|",
        f"| create (`POST /v1/sessions` through a replica) | {_t(r['create_seconds'])} |",
        f"| cell `{CELL}` (REST, wait) | {_t(r['cell_seconds'])} |",
        f"| cell's answer → `hibernated` in the store (incl. {HIBERNATE_AFTER:g} s idle) "
        f"| {_t(r['hibernate_seconds'])} |",
        f"| the hibernation capture itself (snapshot metadata) | {_t(store['capture_seconds'])} |",
        f"| wake: one cell checking `x`, through the other replica ({r['wake']['sampled']}"
        f" sessions, {r['wake']['moved']} on another node) | {_t(r['wake']['seconds'])} |",
        "",
        "| where | total | per session |",
        "|---|---|---|",
        "| sessions per node | "
        + ", ".join(f"{k}: {v}" for k, v in r["per_node"].items())
        + " | |",
        f"| PostgreSQL `pg_database_size` | {store['database_bytes'] / 2**20:.1f} MiB "
        f"(empty: {r['database_bytes_empty'] / 2**20:.1f} MiB) "
        f"| {(store['database_bytes'] - r['database_bytes_empty']) / n / 1024:.1f} KiB |",
        f"| hibernated rows that name no node (released: no lease to renew) "
        f"| {store.get('hibernated_without_a_node', '-')} | |",
    ]
    for name, t in store["tables"].items():
        if t["bytes"] >= 16384 or t["rows"]:
            rows.append(
                f"| table `{name}` ({t['rows']} rows) | {t['bytes'] / 2**20:.2f} MiB "
                f"| {t['bytes'] / n / 1024:.1f} KiB |"
            )
    rows.append(
        f"| bucket: {bucket['objects']} objects | {bucket['bytes'] / 2**20:.1f} MiB "
        f"| {bucket['bytes'] / n / 1024:.1f} KiB |"
    )
    for kind, k in store["snapshot_kinds"].items():
        rows.append(
            f"| snapshot rows of kind `{kind}`: {k['count']} | {k['bytes'] / 2**20:.1f} MiB "
            f"| {k['bytes'] / n / 1024:.1f} KiB |"
        )
    if r["errors"]["count"]:
        rows += ["", f"Errors: {r['errors']['count']}: {r['errors']['first']}"]
    return "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--wake", type=int, default=20, help="sessions woken afterwards")
    parser.add_argument(
        "--timebox", type=float, default=1500, help="seconds after which no new session starts"
    )
    parser.add_argument("--out", type=Path, help="write the markdown here too")
    parser.add_argument("--json", type=Path, help="write the JSON here too")
    parser.add_argument("--logs", type=Path, help="copy the nodes' and replicas' logs here")
    args = parser.parse_args()
    for why in (postgres.problem(), objects_problem()):
        if why is not None:
            print(f"cannot run: {why}", file=sys.stderr)
            return 1
    result = asyncio.run(
        measure(args.sessions, args.concurrency, args.wake, args.timebox, args.logs)
    )
    text = report(result)
    print(text)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
