"""Node loss and draining on a real loopback cluster (conftest.py: Postgres, 3 node agents,
2 gateway replicas, Docker): kill -9 of a node agent, and its sessions come back on the
other nodes with their state and a ``recovered`` notice naming the lost node; the killed
agent, started again, runs none of them; drain a node, and a session hibernated there
wakes on another node with its state. Every call goes through a gateway replica."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import docker
import httpx
import pytest
from websockets.asyncio.client import connect

from kernelhub.store.postgres import PostgresStore
from tests.conftest import UNIT
from tests.multinode.conftest import Cluster, Node

pytestmark = [pytest.mark.multinode, pytest.mark.docker, pytest.mark.postgres, pytest.mark.s3,
              pytest.mark.timeout(300)]  # fmt: skip


@pytest.fixture
async def store(cluster: Cluster) -> AsyncIterator[PostgresStore]:
    s = await PostgresStore.open(cluster.store_url, node="test")
    yield s
    await s.close()


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def until(what: str, timeout: float, check: Any) -> Any:
    """Poll the coroutine function ``check`` until it returns something truthy."""
    deadline = asyncio.get_running_loop().time() + timeout * UNIT
    while not (found := await check()):
        assert asyncio.get_running_loop().time() < deadline, f"{what} within {timeout * UNIT:g} s"
        await asyncio.sleep(0.1)
    return found


async def run(http: httpx.AsyncClient, token: str, sid: str, code: str) -> dict[str, Any]:
    """One cell through the replica, retried while the session is between nodes."""

    async def attempt() -> dict[str, Any] | None:
        r = await http.post(f"/v1/sessions/{sid}/executions", headers=auth(token),
                            json={"code": code, "wait": True})  # fmt: skip
        if r.status_code in (502, 503):  # its node is gone and no other has it yet
            return None
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    done: dict[str, Any] = await until(f"cell {code!r} ran", 60, attempt)
    return done


async def replay(url: str, token: str, sid: str) -> list[dict[str, Any]]:
    """Every stored event of the session from seq 0, over the stream of a replica."""
    events: list[dict[str, Any]] = []
    ws_url = url.replace("http://", "ws://") + f"/v1/sessions/{sid}/stream?since=0"
    async with connect(ws_url, additional_headers=auth(token)) as ws:
        hello = json.loads(await ws.recv())
        assert hello["type"] == "hello", hello
        while not events or events[-1]["seq"] < hello["last_seq"]:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 30 * UNIT))
            if frame["type"] == "event":
                events.append(frame["event"])
    return events


def stdout(execution: dict[str, Any]) -> str:
    return "".join(e.get("text", "") for e in execution["events"] if e["type"] == "stream")


def sandboxes(node: Node, sid: str) -> int:
    client = docker.from_env(timeout=30)
    try:
        labels = [f"org.kernelhub.instance={node.instance}", f"org.kernelhub.session={sid}"]
        return len(client.containers.list(filters={"label": labels}))
    finally:
        client.close()


async def test_kill_9_of_a_node_agent_brings_its_sessions_back_on_the_others(
    cluster: Cluster, store: PostgresStore
) -> None:
    token: str = cluster.alice  # type: ignore[attr-defined]
    async with httpx.AsyncClient(base_url=cluster.replicas[0].url, timeout=120 * UNIT) as http:
        sids = []
        for _ in range(3):
            r = await http.post("/v1/sessions", json={}, headers=auth(token))
            assert r.status_code == 201, r.text
            sids.append(r.json()["id"])
        for sid in sids:
            assert stdout(await run(http, token, sid, f"x = {sid!r}\nprint(x)")) == f"{sid}\n"
        rows = {sid: await store.get_session(sid) for sid in sids}
        nodes = {sid: row.node if row is not None else None for sid, row in rows.items()}
        victim = next(n for n in cluster.nodes if n.id == nodes[sids[0]])
        lost = [sid for sid in sids if nodes[sid] == victim.id]

        async def exported() -> bool:
            snaps = await store.list_snapshots("alice")
            done = {s.session_id for s in snaps if s.metadata.get("kind") == "checkpoint"}
            return set(lost) <= done

        await until("their checkpoints exported", 60, exported)
        victim.kill9()
        try:
            for sid in lost:

                async def moved(sid: str = sid) -> bool:
                    row = await store.get_session(sid)
                    return row is not None and row.node not in (None, victim.id)

                await until(f"session {sid} adopted", 60, moved)
                assert stdout(await run(http, token, sid, "print(x)")) == f"{sid}\n"
                info = (await http.get(f"/v1/sessions/{sid}", headers=auth(token))).json()
                assert info["recovery"]["lost_node"] == victim.id, info
                assert f"node {victim.id} was lost" in info["recovery"]["message"]
                events = await replay(cluster.replicas[1].url, token, sid)
                seqs = [e["seq"] for e in events]
                assert seqs == sorted(set(seqs)), seqs  # gap-free replay across the move
                notices = [e for e in events if e.get("kind") == "recovered"]
                assert len(notices) == 1 and victim.id in notices[0]["message"]
        finally:
            victim.start()
            victim.wait_ready(f"{victim.address}/readyz", verify=cluster.gateway_tls())
        # Back, it runs none of the sessions it lost: their old sandboxes are gone.
        assert [sandboxes(victim, sid) for sid in lost] == [0] * len(lost)
        for sid in sids:
            with contextlib.suppress(httpx.HTTPError):
                await http.delete(f"/v1/sessions/{sid}", headers=auth(token))


async def test_a_session_hibernated_by_draining_its_node_wakes_on_another(
    cluster: Cluster, store: PostgresStore
) -> None:
    token: str = cluster.alice  # type: ignore[attr-defined]
    admin = cluster.token("ops-failover", admin=True)
    async with httpx.AsyncClient(base_url=cluster.replicas[1].url, timeout=120 * UNIT) as http:
        r = await http.post("/v1/sessions", json={}, headers=auth(token))
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        await run(http, token, sid, "word = 'made on the first node'")
        row = await store.get_session(sid)
        assert row is not None and row.node is not None
        first = row.node
        r = await http.post(f"/v1/admin/nodes/{first}/drain", headers=auth(admin))
        assert r.status_code == 200 and r.json()["draining"] is True, r.text
        try:

            async def hibernated() -> bool:
                row = await store.get_session(sid)
                return row is not None and row.node is None and row.state == "hibernated"

            await until("the drain hibernated it", 60, hibernated)
            assert stdout(await run(http, token, sid, "print(word)")) == "made on the first node\n"
            row = await store.get_session(sid)
            assert row is not None and row.node not in (None, first)
        finally:
            r = await http.post(f"/v1/admin/nodes/{first}/undrain", headers=auth(admin))
            assert r.status_code == 200, r.text
        await http.delete(f"/v1/sessions/{sid}", headers=auth(token))
