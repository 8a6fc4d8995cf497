"""Batches spread over nodes (issue #24 item 7): two gateway processes, each its own node
(``KERNELHUB_STORE__NODE``) with its own data directory, sharing the run's private
PostgreSQL server; real Docker sandboxes. A batch submitted through one node is run by
both, each item exactly once; a cancel through either reaches the items on both; and when
one node is killed (-9) its running items end (never run twice) while the waiting ones
run on the other."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import UNIT
from tests.gateway.conftest import Gateway, gateway_run_dir, remove_sandboxes
from tests.gateway.test_batches import SLEEP, auth, poll
from tests.postgres import PostgresCluster

pytestmark = [pytest.mark.docker, pytest.mark.postgres]

NODES = ("node-a", "node-b")
# Slow enough that both nodes have claimed items before the first ones end.
CELL = "import time\ntime.sleep(1)\nprint('item {n}:', {n} * {n})"


@pytest.fixture
def cluster(postgres_cluster: PostgresCluster, tmp_path: Path) -> Iterator[dict[str, Any]]:
    url = postgres_cluster.fresh_url()
    for node in NODES:
        (tmp_path / node).mkdir()
    gateways = [
        Gateway(
            tmp_path / node / "data", gateway_run_dir(),
            KERNELHUB_STORE__URL=url, KERNELHUB_STORE__NODE=node,
            KERNELHUB_BATCH__CONCURRENCY="2", KERNELHUB_BATCH__PRINCIPAL_CONCURRENCY="2",
            KERNELHUB_BATCH__POLL_INTERVAL="0.2", KERNELHUB_BATCH__LEASE_TTL="6",
        )
        for node in NODES
    ]  # fmt: skip
    try:
        for gw in gateways:
            gw.start()
        yield {"url": url, "a": gateways[0], "b": gateways[1]}
    finally:
        for gw in gateways:
            gw.stop()
        remove_sandboxes()


def printed(item: dict[str, Any]) -> str:
    events = item["result"]["events"]
    return "".join(e["text"] for e in events if e["type"] == "stream")


async def test_a_batch_submitted_to_one_node_runs_on_both_each_item_once(
    cluster: dict[str, Any],
) -> None:
    a, b = cluster["a"], cluster["b"]
    token = a.token("alice")  # the shared store: node b knows it too
    n_items = 8
    body = {
        "items": [{"code": CELL.format(n=n), "idempotency_key": f"k{n}"} for n in range(n_items)]
    }
    async with (
        httpx.AsyncClient(base_url=a.url, timeout=60 * UNIT) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=60 * UNIT) as on_b,
    ):
        r = await on_a.post("/v1/batches", json=body, headers=auth(token))
        assert r.status_code == 202, r.text
        batch_id = r.json()["id"]
        # Read through the other node: the batch is the store's, not node a's.
        await poll(on_b, token, batch_id, lambda x: x["state"] == "finished")
        done = (await on_b.get(f"/v1/batches/{batch_id}", headers=auth(token))).json()
        assert done["counts"] == {"completed": n_items}, done
        nodes = [i["node"] for i in done["items"]]
        assert set(nodes) == set(NODES), nodes  # both ran some
        for n, item in enumerate(done["items"]):
            assert printed(item) == f"item {n}: {n * n}\n", item
        assert len({i["session_id"] for i in done["items"]}) == n_items
        # Sent again through b: every item is a duplicate, nothing runs.
        again = (await on_b.post("/v1/batches", json=body, headers=auth(token))).json()
        assert [i["duplicate_of"]["index"] for i in again["items"]] == list(range(n_items))

        # Exactly once, by the store's own rows: one execution per item, one session each,
        # and each session made by the node the item names.
        import psycopg

        with psycopg.connect(cluster["url"]) as db:
            codes = dict(db.execute("SELECT code, COUNT(*) FROM executions GROUP BY code"))
            sessions = db.execute("SELECT metadata, node FROM sessions").fetchall()
        assert codes == {CELL.format(n=n): 1 for n in range(n_items)}, codes
        made = sorted((json.loads(m)["kernelhub.batch_index"], node) for m, node in sessions)
        assert made == list(enumerate(nodes)), made

        # A cancel through b stops the items running on a as well.
        r = await on_a.post(
            "/v1/batches", json={"items": [{"code": SLEEP}] * 6}, headers=auth(token)
        )
        slow = r.json()["id"]
        running = await poll(
            on_a, token, slow,
            lambda x: sum(1 for i in x["items"] if i["execution_id"]) == 4,
        )  # fmt: skip
        assert {i["node"] for i in running["items"] if i["execution_id"]} == set(NODES)
        r = await on_b.post(f"/v1/batches/{slow}/cancel", headers=auth(token))
        assert r.status_code == 200, r.text
        ended = await poll(on_a, token, slow, lambda x: x["state"] == "cancelled")
        assert ended["counts"] == {"interrupted": 4, "cancelled": 2}, ended
        for http in (on_a, on_b):  # every item's session is gone, on both nodes
            r = await http.get("/v1/sessions", headers=auth(token))
            assert r.json() == {"sessions": []}

        # Node a is killed (-9) while two items run there: once its leases run out they
        # end failed, naming it, and never run again; the waiting items run on b.
        code = ["import time\ntime.sleep(10)\nprint('slow')"] * 4 + ["print('quick')"] * 2
        r = await on_a.post(
            "/v1/batches", json={"items": [{"code": c} for c in code]}, headers=auth(token)
        )
        late = r.json()["id"]
        await poll(
            on_b, token, late, lambda x: sum(1 for i in x["items"] if i["execution_id"]) == 4
        )
        a.kill9()
        await poll(on_b, token, late, lambda x: x["state"] == "finished")
        ended = (await on_b.get(f"/v1/batches/{late}", headers=auth(token))).json()
        lost = [i for i in ended["items"] if i["node"] == "node-a"]
        assert len(lost) == 2 and all(i["status"] == "failed" for i in lost), ended
        assert all("(node-a) stopped or lost touch while its code ran" in i["error"] for i in lost)
        ran = [i for i in ended["items"] if i["node"] == "node-b"]
        assert [(i["index"], i["status"]) for i in ran][-2:] == [(4, "completed"), (5, "completed")]
        assert [printed(i) for i in ran] == ["slow\n", "slow\n", "quick\n", "quick\n"]
