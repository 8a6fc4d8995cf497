"""Draining and listing nodes, through the admin routes (the real app on a seeded SQLite
store) and ``kernelhub node`` (in process, on a store in a temporary data directory)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kernelhub.cli import main
from kernelhub.cluster.models import NodeInfo
from kernelhub.config import load_settings
from kernelhub.store import open_store
from kernelhub.store.sqlite import SqliteStore
from kernelhub.tokens import TokenCreate, mint
from tests.unit.gateway.app_rig import Gateway, serve


def beat(nid: str, lease: float) -> NodeInfo:
    now = datetime.now(UTC)
    return NodeInfo(
        id=nid, address=f"https://{nid}:8766", started_at=now, heartbeat_at=now,
        lease_expires_at=now + timedelta(seconds=lease), sessions=3,
        memory_free_bytes=2**32, cpu_load=0.25,
    )  # fmt: skip


async def seed(store: SqliteStore) -> dict[str, str]:
    await store.upsert_node(beat("n1", 3600))
    await store.upsert_node(beat("n2", -5))  # lost
    admin = await mint(store, TokenCreate(name="ops", admin=True))
    user = await mint(store, TokenCreate(name="alice"))
    return {"admin": admin.token, "user": user.token}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from serve(tmp_path_factory, seed)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_admins_list_nodes_with_their_heartbeats(gateway: Gateway) -> None:
    client, tokens = gateway
    r = client.get("/v1/admin/nodes", headers=auth(tokens["admin"]))
    assert r.status_code == 200, r.text
    nodes = {n["id"]: n for n in r.json()["nodes"]}
    assert (nodes["n1"]["lost"], nodes["n2"]["lost"]) == (False, True)
    assert nodes["n1"]["sessions"] == 3 and nodes["n1"]["cpu_load"] == 0.25
    assert client.get("/v1/admin/nodes", headers=auth(tokens["user"])).status_code == 403


def test_drain_and_undrain_a_node(gateway: Gateway) -> None:
    client, tokens = gateway
    r = client.post("/v1/admin/nodes/n1/drain", headers=auth(tokens["admin"]))
    assert r.status_code == 200 and r.json()["draining"] is True, r.text
    listed = client.get("/v1/admin/nodes", headers=auth(tokens["admin"])).json()["nodes"]
    assert [n["draining"] for n in listed if n["id"] == "n1"] == [True]
    r = client.post("/v1/admin/nodes/n1/undrain", headers=auth(tokens["admin"]))
    assert r.status_code == 200 and r.json()["draining"] is False
    r = client.post("/v1/admin/nodes/nope/drain", headers=auth(tokens["admin"]))
    assert r.status_code == 404 and "nope" in r.json()["message"]
    assert client.post("/v1/admin/nodes/n1/drain", headers=auth(tokens["user"])).status_code == 403


def test_the_node_command_lists_drains_and_undrains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("KERNELHUB_DATA_DIR", str(data))

    async def prepare() -> None:
        store = await open_store(load_settings(data_dir=data))
        try:
            await store.upsert_node(beat("n1", 3600))
        finally:
            await store.close()

    async def draining() -> bool:
        store = await open_store(load_settings(data_dir=data))
        try:
            node = await store.get_node("n1")
            assert node is not None
            return node.draining
        finally:
            await store.close()

    asyncio.run(prepare())
    assert main(["node", "drain", "n1"]) == 0 and asyncio.run(draining())
    assert "n1: draining" in capsys.readouterr().out
    assert main(["node", "ls"]) == 0
    out = capsys.readouterr().out
    assert "n1" in out and "up, draining" in out and "https://n1:8766" in out
    assert main(["node", "ls", "--json"]) == 0
    assert [n["id"] for n in json.loads(capsys.readouterr().out)] == ["n1"]
    assert main(["node", "undrain", "n1"]) == 0 and not asyncio.run(draining())
    assert main(["node", "drain", "nope"]) == 1
    assert "no node 'nope'" in capsys.readouterr().err
