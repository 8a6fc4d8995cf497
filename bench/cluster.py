"""``1+1`` over the WebSocket through a gateway replica to a node agent, against the same
cell on a single-machine gateway, in interleaved rounds.

    python bench/cluster.py [--rounds 5] [--per-round 40] [--out docs/bench-cluster.md]

Run from a checkout with the repository root on PYTHONPATH: it starts the multinode tier's
cluster (``tests/multinode/conftest.py``: a private PostgreSQL, one node agent on
127.0.0.2 over mutual TLS, one replica on 127.0.0.1) and, beside it, ``kernelhub serve``
on SQLite (``bench/gateway.py``). Contenders, each one session with one open stream:

- ``single``: the single-machine gateway on its embedded SQLite (what a client has
  without a cluster);
- ``single-pg``: the same gateway on the cluster's PostgreSQL server (its own schema):
  the local gateway with the cluster's store, so that ``replica`` over it is what the
  cluster's network path costs (mutual TLS, the replica's hop);
- ``node``: straight to the node agent over mutual TLS;
- ``replica``: through the replica to the node.

Target: ``replica`` ≤ 1.2 × a local gateway. Reported as the median of the rounds' medians with
their [min-max], and the ratio as the median of the rounds' own ratios (``rounds.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from gateway import Gateway, create_session
from report import ms
from rounds import Rounds, interleave
from websockets.asyncio.client import ClientConnection, connect

from kernelhub.cluster.settings import ClusterSettings
from tests import postgres
from tests.multinode.conftest import Cluster, tls_context


class Stream:
    """One open stream of one session, running ``1+1`` to its ``final`` event."""

    def __init__(self, url: str, headers: dict[str, str], tls: ssl.SSLContext | None) -> None:
        self.url, self.headers, self.tls = url, headers, tls
        self.conn: ClientConnection | None = None

    async def open(self) -> Stream:
        self.conn = await connect(
            self.url, additional_headers=self.headers, ssl=self.tls, max_size=2**26,
            compression=None, proxy=None,
        )  # fmt: skip
        json.loads(await self.conn.recv())  # hello
        return self

    async def run(self) -> float:
        assert self.conn is not None
        request = uuid.uuid4().hex
        t0 = time.perf_counter()
        await self.conn.send(json.dumps({"type": "execute", "code": "1+1", "request_id": request}))
        mine = None
        finals: set[str] = set()
        while True:
            frame: dict[str, Any] = json.loads(await self.conn.recv())
            if frame["type"] == "accepted" and frame.get("request_id") == request:
                mine = frame["execution_id"]
            elif frame["type"] == "event" and frame["event"]["type"] == "final":
                finals.add(frame["event"]["execution_id"])
            if mine is not None and mine in finals:
                return time.perf_counter() - t0

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()


async def measure(rounds: int, per_round: int) -> Rounds:
    pg = postgres.PostgresCluster()
    pg.start()
    streams: list[Stream] = []
    with tempfile.TemporaryDirectory(prefix="kh-bench-cluster-") as tmp:
        root = Path(tmp)
        cluster = Cluster(
            root / "cluster", pg.fresh_url(), nodes=1, replicas=1,
            export_interval=ClusterSettings().checkpoint_export_interval or 0,
        )  # fmt: skip
        single = single_pg = None
        try:
            await asyncio.to_thread(cluster.start)
            (root / "single").mkdir()
            single = await Gateway.launch(
                root / "single", instance=f"bcl-{uuid.uuid4().hex[:6]}",
                env={"KERNELHUB_POOL__SIZE": "0"},
            )  # fmt: skip
            (root / "single-pg").mkdir()
            single_pg = await Gateway.launch(
                root / "single-pg", instance=f"bcp-{uuid.uuid4().hex[:6]}",
                env={"KERNELHUB_POOL__SIZE": "0", "KERNELHUB_STORE__URL": pg.fresh_url()},
            )  # fmt: skip
            token = await asyncio.to_thread(cluster.token, "bench")
            auth = {"Authorization": f"Bearer {token}"}
            replica, node = cluster.replicas[0], cluster.nodes[0]
            async with httpx.AsyncClient(base_url=replica.url, headers=auth, timeout=120) as h:
                clustered = await create_session(h)
            async with single.client() as h:
                alone = await create_session(h)
            async with single_pg.client() as h:
                alone_pg = await create_session(h)
            path = "/v1/sessions/{}/stream"
            gateway_tls = tls_context(cluster.certs, "gateway-bench")
            contenders = {
                "single": Stream(single.ws_url + path.format(alone), single.headers, None),
                "single-pg": Stream(
                    single_pg.ws_url + path.format(alone_pg), single_pg.headers, None
                ),
                "node": Stream(
                    node.address.replace("https", "wss") + path.format(clustered), auth, gateway_tls
                ),
                "replica": Stream(
                    replica.url.replace("http", "ws") + path.format(clustered), auth, None
                ),
            }
            streams = [await s.open() for s in contenders.values()]
            return await interleave(
                {name: s.run for name, s in contenders.items()},
                rounds=rounds, per_round=per_round, warmup=10,
            )  # fmt: skip
        finally:
            for s in streams:
                await s.close()
            for gw in (single, single_pg):
                if gw is not None:
                    await gw.stop()
            await asyncio.to_thread(cluster.stop)
            pg.stop()


def report(s: Rounds) -> str:
    rows = [
        "| `1+1` over the WebSocket | median [min-max] | vs single (SQLite) | vs single (PostgreSQL) |",
        "|---|---|---|---|",
    ]
    for name, label in (
        ("single", "single-machine gateway, SQLite (the default)"),
        ("single-pg", "single-machine gateway, PostgreSQL (the local floor)"),
        ("node", "straight to a node agent (mutual TLS, PostgreSQL)"),
        ("replica", "through a gateway replica to the node"),
    ):
        spread = s.spread(name)
        cells = [f"{ms(spread.median)} [{ms(spread.lo)}-{ms(spread.hi)}]"]
        for floor in ("single", "single-pg"):
            r = s.ratio(name, floor)
            cells.append(f"{r.median:.2f}× [{r.lo:.2f}-{r.hi:.2f}]")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    r = s.ratio("replica", "node")
    rows.append(
        f"\nThe replica's own hop: {r.median:.2f}× [{r.lo:.2f}-{r.hi:.2f}] the node straight."
    )
    return "\n".join(rows) + "\n\nTarget: through a replica ≤ 1.2 × a local gateway.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = report(asyncio.run(measure(args.rounds, args.per_round)))
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
