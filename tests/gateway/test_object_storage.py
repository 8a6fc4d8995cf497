"""Snapshots and hibernation in object storage, end to end: two real gateways ("nodes"),
each with its own data directory and instance (so neither sees the other's files or
state directories), sharing the run's private PostgreSQL server, one bucket of the run's
``rclone serve s3`` and the cluster's snapshot key. What one node captured, the other
restores: the bytes can only have come through the bucket."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RUN_INSTANCE, UNIT
from tests.gateway.conftest import Gateway, gateway_run_dir, remove_sandboxes
from tests.gateway.test_gateway import auth, new_session, run, stdout
from tests.objects import S3Server
from tests.postgres import PostgresCluster

pytestmark = [pytest.mark.docker, pytest.mark.postgres, pytest.mark.s3]

STATE = """\
import numpy as np
x = np.arange(10**6)
msg = 'made on node a'
"""


class Cluster:
    """Nodes that share a store, a bucket and a key; each one stopped, and its sandboxes
    removed, at the end."""

    def __init__(self, root: Path, pg: PostgresCluster, s3: S3Server) -> None:
        self.root, self.s3 = root, s3
        self.bucket = s3.fresh_bucket()
        key = root / "cluster.key"
        key.write_bytes(os.urandom(32))
        self.env = {
            "KERNELHUB_STORE__URL": pg.fresh_url(),
            "KERNELHUB_CLUSTER__SNAPSHOT_KEY_FILE": str(key),
            **s3.env(self.bucket),
        }
        self.nodes: list[Gateway] = []

    def node(self, name: str, **env: str) -> Gateway:
        gw = Gateway(self.root / name, gateway_run_dir(), **self.env,
                     KERNELHUB_GATEWAY__INSTANCE=f"{RUN_INSTANCE}-o{name}", **env)  # fmt: skip
        gw.start()
        self.nodes.append(gw)
        return gw

    def blobs(self) -> dict[str, int]:
        return self.s3.keys(self.bucket)

    def close(self) -> None:
        for gw in self.nodes:
            gw.stop()
        for gw in self.nodes:
            remove_sandboxes(gw.env["KERNELHUB_GATEWAY__INSTANCE"])


@pytest.fixture
def cluster(
    tmp_path: Path, postgres_cluster: PostgresCluster, s3_server: S3Server
) -> Iterator[Cluster]:
    made = Cluster(tmp_path, postgres_cluster, s3_server)
    try:
        yield made
    finally:
        made.close()


def local_blobs(gw: Gateway) -> list[str]:
    root = Path(gw.env["KERNELHUB_DATA_DIR"]) / "snapshots"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


async def test_a_snapshot_taken_on_one_node_restores_on_another(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    token = a.token("alice")
    async with (
        httpx.AsyncClient(base_url=a.url, timeout=120 * UNIT) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=120 * UNIT) as on_b,
    ):
        sid = await new_session(on_a, token)
        await run(on_a, token, sid, STATE)
        r = await on_a.post(f"/v1/sessions/{sid}/snapshots", headers=auth(token))
        assert r.status_code in (200, 201), r.text
        snap = r.json()
        # Stored means uploaded: the object is there as soon as the call answered.
        assert cluster.blobs() == {f"kernelhub/snapshots/{snap['id']}.blob": snap["size_bytes"]}
        assert local_blobs(a) == [f"{snap['id']}.blob"] and local_blobs(b) == []
        r = await on_b.post("/v1/sessions", json={"from_snapshot": snap["id"]}, headers=auth(token))
        assert r.status_code == 201, r.text
        assert set(r.json()["restore"]["restored"]) >= {"x", "msg"}, r.json()["restore"]
        out = await run(on_b, token, r.json()["id"], "print(msg, int(x.sum()))")
        assert stdout(out) == "made on node a 499999500000\n", out["events"]

        # One byte changed in the bucket: node b refuses it before its sandbox gets any.
        r = await on_a.post(f"/v1/sessions/{sid}/snapshots", headers=auth(token))
        edited_id = r.json()["id"]
        key = f"kernelhub/snapshots/{edited_id}.blob"
        s3 = cluster.s3.client()
        body = bytearray(s3.get_object(Bucket=cluster.bucket, Key=key)["Body"].read())
        body[len(body) // 2] ^= 1
        s3.put_object(Bucket=cluster.bucket, Key=key, Body=bytes(body))
        r = await on_b.post("/v1/sessions", json={"from_snapshot": edited_id}, headers=auth(token))
        # (Refused on download, "in the bucket": not by the check as it streams.)
        assert r.status_code == 400 and "in the bucket" in r.text, r.text

        # Deleted on either node, gone from the bucket.
        r = await on_b.delete(f"/v1/snapshots/{snap['id']}", headers=auth(token))
        assert r.status_code == 204, r.text
        assert list(cluster.blobs()) == [key]


async def test_a_session_hibernated_on_one_node_wakes_on_another(cluster: Cluster) -> None:
    # Node a keeps nothing for a hibernated session (the many-sessions-per-node setting);
    # node b never saw a's disk either way.
    a = cluster.node(
        "a",
        KERNELHUB_GATEWAY__HIBERNATE_AFTER=str(2 * UNIT),
        KERNELHUB_GATEWAY__HIBERNATE_STANDBY="false",
        KERNELHUB_GATEWAY__HIBERNATE_KEEP_STATE="false",
    )
    token = a.token("alice")
    async with httpx.AsyncClient(base_url=a.url, timeout=120 * UNIT) as on_a:
        sid = await new_session(on_a, token)
        await run(on_a, token, sid, STATE)
        deadline = time.monotonic() + 60 * UNIT
        while (await on_a.get(f"/v1/sessions/{sid}", headers=auth(token))).json()[
            "state"
        ] != "hibernated":
            assert time.monotonic() < deadline, "the session never hibernated"
            await asyncio.sleep(0.1)
    [(key, size)] = cluster.blobs().items()
    assert key.startswith("kernelhub/snapshots/") and size > 8 * 10**6  # x alone is 8 MB
    # The bucket holds it; node a, nothing: no blob file, no state directory.
    assert local_blobs(a) == []
    instance = a.env["KERNELHUB_GATEWAY__INSTANCE"]
    assert not (gateway_run_dir() / instance / f"{sid}.state").exists()
    assert (gateway_run_dir() / instance).is_dir()  # (where it would have been)
    a.stop()  # node a is gone; node b has never seen its disk
    b = cluster.node("b")
    s3 = cluster.s3.client()
    whole = s3.get_object(Bucket=cluster.bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=cluster.bucket, Key=key, Body=whole[:-1])
    async with httpx.AsyncClient(base_url=b.url, timeout=120 * UNIT) as on_b:
        info = (await on_b.get(f"/v1/sessions/{sid}", headers=auth(token))).json()
        assert info["state"] == "hibernated", info
        # A wake refused (the blob edited in the bucket) is no kernel death: the session
        # stays hibernated, and wakes once the blob is whole again.
        r = await on_b.post(
            f"/v1/sessions/{sid}/executions", json={"code": "1", "wait": True},
            headers=auth(token),
        )  # fmt: skip
        assert r.status_code == 400 and "in the bucket" in r.text, r.text
        s3.put_object(Bucket=cluster.bucket, Key=key, Body=whole)
        out = await run(on_b, token, sid, "print(msg, int(x.sum()))")
        assert stdout(out) == "made on node a 499999500000\n", out["events"]
    # Woken: the hibernation snapshot is dropped, in the bucket too.
    assert cluster.blobs() == {} and local_blobs(b) == []
    said = b.log.read_text()
    assert "ends dead" not in said and "Task exception was never retrieved" not in said, said


def test_object_storage_without_the_cluster_key_refuses_to_start(tmp_path: Path) -> None:
    # (A key file that is missing or too short: tests/unit/snapshot/test_blob_store.py.)
    env = {
        "KERNELHUB_OBJECTS__ENDPOINT_URL": "http://127.0.0.1:9",
        "KERNELHUB_OBJECTS__BUCKET": "snapshots",
    }
    gw = Gateway(tmp_path / "data", gateway_run_dir(), **env)
    done = subprocess.run([sys.executable, "-m", "kernelhub.cli", "serve"], env=gw.env,
                          capture_output=True, text=True, timeout=120 * UNIT)  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "KERNELHUB_CLUSTER__SNAPSHOT_KEY_FILE" in said, said
    assert not (tmp_path / "data" / "snapshot.key").exists()
