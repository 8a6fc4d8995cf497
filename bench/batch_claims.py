"""Would a broker earn its place beside the store's batch queue (issue #24 item 7)? The
claim rate the store sustains against the item rate real batches need.

    python bench/batch_claims.py [--workers 2] [--seconds 10] [--limit 1]
        [--url postgresql://...] [--gateway http://127.0.0.1:8765 --token kh_...]

Claims: ``--workers`` processes, each a node with its own :class:`PostgresStore`
connection, claim from one shared queue (``--principals`` principals, a batch each, far
more items than the run takes) as fast as they can, and finish each claimed item at once
(the update a real item makes when it ends): claims/s and items/s, all workers together,
and the claim's latency. Without ``--url`` a private PostgreSQL server is started (the
test suite's, tests/postgres.py: unix socket only, fsync off), and SQLite runs the same
loop in one process for comparison. This measures the queue's ceiling: no sandbox runs.

Items: with ``--gateway`` and ``--token`` a real batch of ``--items`` ``1+1`` cells runs
through that gateway (real sandboxes, a fresh session each) and its items/s is reported:
the rate the queue has to keep up with, per node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kernelhub.models import ExecutionStatus
from kernelhub.store.postgres import PostgresStore
from kernelhub.store.records import StoredBatch, StoredBatchItem
from kernelhub.store.sql import SqlStore
from kernelhub.store.sqlite import SqliteStore
from kernelhub.wire import BatchItemIn

BODY = BatchItemIn(code="1+1").model_dump_json()


async def fill(store: SqlStore, principals: int, items: int) -> None:
    now = datetime.now(UTC)
    for p in range(principals):
        batch = StoredBatch(id=f"b{p}", owner=f"p{p}", created_at=now + timedelta(seconds=p),
                            concurrency=10_000)  # fmt: skip
        rows = [
            StoredBatchItem(batch_id=batch.id, index=n, owner=batch.owner, queued_at=now, body=BODY)
            for n in range(items)
        ]
        await store.insert_batch(batch, rows)


async def claim_loop(store: SqlStore, node: str, seconds: float, limit: int) -> dict[str, Any]:
    claims = items = 0
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        got = await store.claim_batch_items(node, limit, 30.0)
        latencies.append(time.perf_counter() - t0)
        claims += 1
        for item in got.items:
            await store.update_batch_item(item.batch_id, item.index,
                                          status=ExecutionStatus.COMPLETED,
                                          finished_at=datetime.now(UTC), claimed_by=node)  # fmt: skip
        items += len(got.items)
    return {"claims": claims, "items": items, "latencies": latencies}


def _worker(url: str, node: str, seconds: float, limit: int, out: Any) -> None:
    async def run() -> dict[str, Any]:
        store = await PostgresStore.open(url, node=node)
        try:
            return await claim_loop(store, node, seconds, limit)
        finally:
            await store.close()

    out.put(asyncio.run(run()))


def summary(results: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    lat = sorted(x for r in results for x in r["latencies"])
    return {
        "claims_per_s": round(sum(r["claims"] for r in results) / seconds, 1),
        "items_per_s": round(sum(r["items"] for r in results) / seconds, 1),
        "claim_p50_ms": round(statistics.median(lat) * 1000, 2),
        "claim_p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 2),
    }


def postgres_claims(url: str, args: argparse.Namespace) -> dict[str, float]:
    async def prepare() -> None:
        store = await PostgresStore.open(url, node="filler")
        try:
            await fill(store, args.principals, args.queue)
        finally:
            await store.close()

    asyncio.run(prepare())
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(url, f"n{w}", args.seconds, args.limit, out))
        for w in range(args.workers)
    ]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return summary(results, args.seconds)


def sqlite_claims(args: argparse.Namespace) -> dict[str, float]:
    async def run() -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as d:
            store = await SqliteStore.open(Path(d) / "kh.sqlite3", node="n0")
            try:
                await fill(store, args.principals, args.queue)
                return await claim_loop(store, "n0", args.seconds, args.limit)
            finally:
                await store.close()

    return summary([asyncio.run(run())], args.seconds)


def gateway_items(url: str, token: str, items: int) -> dict[str, float]:
    import httpx

    headers = {"Authorization": f"Bearer {token}"}
    body = {"items": [{"code": "1+1"} for _ in range(items)]}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
        t0 = time.perf_counter()
        r = http.post("/v1/batches", json=body)
        r.raise_for_status()
        batch = r.json()["id"]
        while True:
            info = http.get(f"/v1/batches/{batch}", params={"results": "false"}).json()
            if info["state"] == "finished":
                break
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        concurrency = info["concurrency"]
    return {"items": items, "concurrency": concurrency, "seconds": round(seconds, 2),
            "items_per_s": round(items / seconds, 2), "counts": info["counts"]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--limit", type=int, default=1, help="items asked for per claim")
    parser.add_argument("--principals", type=int, default=4)
    parser.add_argument("--queue", type=int, default=2_500, help="items per principal")
    parser.add_argument("--url", help="a PostgreSQL URL (default: a private server)")
    parser.add_argument("--gateway", help="a gateway's URL, for the real items' rate")
    parser.add_argument("--token")
    parser.add_argument("--items", type=int, default=40)
    args = parser.parse_args()
    report: dict[str, Any] = {"workers": args.workers, "limit": args.limit}
    if args.url:
        report["postgres"] = postgres_claims(args.url, args)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.postgres import PostgresCluster, problem

        if (why := problem()) is not None:
            print(f"no PostgreSQL here: {why}", file=sys.stderr)
            return 1
        server = PostgresCluster()
        server.start()
        try:
            report["postgres"] = postgres_claims(server.fresh_url(), args)
        finally:
            server.stop()
        report["sqlite_one_node"] = sqlite_claims(args)
    if args.gateway and args.token:
        report["gateway_batch"] = gateway_items(args.gateway, args.token, args.items)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
