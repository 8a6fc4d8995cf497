"""Storage is bounded and deletion is real, end to end: a real gateway process, real
Docker sandboxes, the store's file measured from outside."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.conftest import UNIT, eventually
from tests.gateway.conftest import Gateway
from tests.gateway.test_gateway import _run_dir, auth, new_session, run, stdout

pytestmark = pytest.mark.docker

QUOTA = 3_000_000  # alice's and quinn's override; everyone else has the default (1 GiB)
RETENTION = 5.0  # long enough for a few requests under load, short enough to wait for


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = Gateway(
        tmp_path_factory.mktemp("storage") / "data",
        _run_dir(),
        KERNELHUB_STORAGE__QUOTAS=json.dumps({"alice": QUOTA, "quinn": QUOTA}),
        KERNELHUB_STORAGE__RETENTION=str(RETENTION * UNIT),
        KERNELHUB_STORAGE__SWEEP_INTERVAL=str(0.5 * UNIT),
        KERNELHUB_GATEWAY__RECOVER_CRASHED="false",  # a kernel that dies ends its session
    )
    gateway.start()
    yield gateway
    gateway.stop()


def db_path(gateway: Gateway) -> Path:
    return Path(gateway.env["KERNELHUB_DATA_DIR"]) / "kernelhub.sqlite3"


def count(gateway: Gateway, sql: str, *params: Any) -> int:
    with contextlib.closing(sqlite3.connect(db_path(gateway))) as db:
        return int(db.execute(sql, params).fetchone()[0])


def store_bytes(gateway: Gateway) -> int:
    """The store's footprint on disk: the database file and its write-ahead log."""
    path = db_path(gateway)
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


async def test_a_principal_over_its_quota_is_refused_while_another_is_not(gw: Gateway) -> None:
    alice, bob = gw.token("alice"), gw.token("bob")
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        mine, theirs = await new_session(http, alice), await new_session(http, bob)
        # Under the quota when it starts, so it runs; afterwards alice is over it.
        big = await run(http, alice, mine, "print('x' * 4_000_000)")
        assert big["status"] == "completed"
        r = await http.post(
            f"/v1/sessions/{mine}/executions",
            json={"code": "1+1", "wait": True},
            headers=auth(alice),
        )
        assert r.status_code == 507, r.text
        body = r.json()
        assert body["error"] == "storage_full"
        assert str(QUOTA) in body["message"] and "KERNELHUB_STORAGE__QUOTA" in body["message"]
        used = int(body["message"].split(" stores ")[1].split()[0])
        assert used > QUOTA
        r = await http.post("/v1/sessions", json={}, headers=auth(alice))
        assert r.status_code == 507 and r.json()["error"] == "storage_full"
        r = await http.post("/v1/batches", json={"items": [{"code": "1"}]}, headers=auth(alice))
        assert r.status_code == 507 and r.json()["error"] == "storage_full"
        # The socket refuses the same way, and stays open.
        url = f"{gw.ws_url}/v1/sessions/{mine}/stream?since={big['events'][-1]['seq']}"
        async with connect(url, additional_headers=auth(alice)) as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
            await ws.send(json.dumps({"type": "execute", "code": "1+1", "request_id": "r1"}))
            frame = json.loads(await ws.recv())
            assert frame["type"] == "error" and frame["request_id"] == "r1", frame
            assert frame["error"] == "storage_full" and str(QUOTA) in frame["message"]
            await ws.send(json.dumps({"type": "ping", "request_id": "p"}))
            assert json.loads(await ws.recv()) == {"type": "pong", "request_id": "p"}
        # Bob is not alice: his cells run as before.
        assert stdout(await run(http, bob, theirs, "print(6 * 7)")) == "42\n"
        # Purging what she stored gives alice her quota back.
        r = await http.delete(f"/v1/sessions/{mine}", params={"purge": "true"}, headers=auth(alice))
        assert r.status_code == 204
        again = await new_session(http, alice)
        assert stdout(await run(http, alice, again, "print('room')")) == "room\n"
        for token, sid in ((alice, again), (bob, theirs)):
            await http.delete(f"/v1/sessions/{sid}", params={"purge": "true"}, headers=auth(token))


async def test_queued_cells_cannot_overshoot_the_quota(gw: Gateway) -> None:
    # Checked against stored bytes alone, every cell queued behind a running one passed
    # (nothing stored yet) and then wrote up to its output cap: 5 x 2 MB against 3 MB.
    quinn = gw.token("quinn")
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, quinn)
        r = await http.post(
            f"/v1/sessions/{sid}/executions",
            json={"code": "import time\ntime.sleep(600)"},
            headers=auth(quinn),
        )
        assert r.status_code == 202, r.text
        first = r.json()["id"]
        answers = [
            await http.post(
                f"/v1/sessions/{sid}/executions",
                json={"code": "print('q' * 2_000_000)"},
                headers=auth(quinn),
            )
            for _ in range(5)
        ]
        assert [a.status_code for a in answers] == [507] * 5, [a.text for a in answers]
        body = answers[0].json()
        assert body["error"] == "storage_full" and "reserved" in body["message"], body
        assert str(QUOTA) in body["message"] and "KERNELHUB_STORAGE__QUOTA" in body["message"]
        # The running cell's reservation ends with it: the next cell runs.
        await http.post(f"/v1/executions/{first}/interrupt", headers=auth(quinn))

        deadline = time.monotonic() + 60 * UNIT
        while (await http.get(f"/v1/executions/{first}?events=false", headers=auth(quinn))).json()[
            "record"
        ] is None:
            assert time.monotonic() < deadline, "the interrupted cell never finished"
            await asyncio.sleep(0.05)
        done = await run(http, quinn, sid, "print('q' * 2_000_000)")
        assert done["status"] == "completed"
        info = (await http.get(f"/v1/sessions/{sid}", headers=auth(quinn))).json()
        assert info["stored_bytes"] < QUOTA, info
        await http.delete(f"/v1/sessions/{sid}", params={"purge": "true"}, headers=auth(quinn))


async def test_delete_with_purge_removes_the_events_and_the_file_shrinks(gw: Gateway) -> None:
    carol = gw.token("carol")
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, carol)
        cells = [await run(http, carol, sid, f"print('{c}' * 9_000_000)") for c in "ab"]
        assert all(c["status"] == "completed" for c in cells)
        before = store_bytes(gw)
        events = count(gw, "SELECT COUNT(*) FROM events WHERE session_id = ?", sid)
        assert events > 0
        r = await http.delete(f"/v1/sessions/{sid}", params={"purge": "true"}, headers=auth(carol))
        assert r.status_code == 204
        after = store_bytes(gw)
        print(f"\nstore before purge {before} bytes ({events} events), after {after} bytes")
        assert count(gw, "SELECT COUNT(*) FROM events WHERE session_id = ?", sid) == 0
        assert count(gw, "SELECT COUNT(*) FROM executions WHERE session_id = ?", sid) == 0
        assert before - after > 15_000_000, (before, after)
        r = await http.get(f"/v1/executions/{cells[0]['id']}", headers=auth(carol))
        assert r.status_code == 404
        assert (await http.get(f"/v1/sessions/{sid}", headers=auth(carol))).status_code == 404


async def test_a_deleted_session_is_purged_after_its_retention(gw: Gateway) -> None:
    dave, eve = gw.token("dave"), gw.token("eve")  # CLI calls take seconds: before the clock runs
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, dave)
        cell = await run(http, dave, sid, "print('kept for a while')")
        assert (await http.delete(f"/v1/sessions/{sid}", headers=auth(dave))).status_code == 204
        # Within its retention the history is still there to read.
        r = await http.get(f"/v1/executions/{cell['id']}", headers=auth(dave))
        assert r.status_code == 200 and stdout(r.json()) == "kept for a while\n"
        # A session deleted earlier can still be purged at once; not by someone else.
        other = await new_session(http, dave)
        await run(http, dave, other, "print('purge me later')")
        assert (await http.delete(f"/v1/sessions/{other}", headers=auth(dave))).status_code == 204
        r = await http.delete(f"/v1/sessions/{other}", params={"purge": "true"}, headers=auth(eve))
        assert r.status_code == 404
        assert count(gw, "SELECT COUNT(*) FROM events WHERE session_id = ?", other) > 0
        r = await http.delete(f"/v1/sessions/{other}", params={"purge": "true"}, headers=auth(dave))
        assert r.status_code == 204
        assert count(gw, "SELECT COUNT(*) FROM events WHERE session_id = ?", other) == 0

    # A session whose kernel died has ended too: its retention runs from its death.
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        corpse = await new_session(http, dave)
        r = await http.post(
            f"/v1/sessions/{corpse}/executions",
            json={"code": "import os\nos._exit(3)", "wait": True}, headers=auth(dave),
        )  # fmt: skip
        assert r.status_code == 200, r.text
        for _ in range(200):
            state = (await http.get(f"/v1/sessions/{corpse}", headers=auth(dave))).json()["state"]
            if state == "dead":
                break
            await asyncio.sleep(0.05)
        assert state == "dead"

    def purged() -> bool:
        return all(
            count(gw, "SELECT COUNT(*) FROM events WHERE session_id = ?", s) == 0
            for s in (sid, corpse)
        )

    await eventually(purged, timeout=RETENTION + 10)
    assert count(gw, "SELECT COUNT(*) FROM executions WHERE session_id = ?", sid) == 0
    assert count(gw, "SELECT COUNT(*) FROM sessions WHERE id = ?", sid) == 0
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        r = await http.get(f"/v1/executions/{cell['id']}", headers=auth(dave))
        assert r.status_code == 404
        assert (await http.get(f"/v1/sessions/{corpse}", headers=auth(dave))).status_code == 404


async def test_the_audit_log_keeps_who_when_what_with_the_code_bounded(gw: Gateway) -> None:
    erin = gw.token("erin")
    code = "x = 1  # " + "a" * 100_000
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, erin)
        assert (await run(http, erin, sid, code))["status"] == "completed"
        await http.delete(f"/v1/sessions/{sid}", params={"purge": "true"}, headers=auth(erin))
    with contextlib.closing(sqlite3.connect(db_path(gw))) as db:
        row = db.execute(
            "SELECT principal, at, code, code_bytes, code_sha256 FROM audit"
            " WHERE session_id = ? AND action = 'execution'",
            (sid,),
        ).fetchone()
        purge = db.execute(
            "SELECT detail FROM audit WHERE session_id = ? AND action = 'session.delete'", (sid,)
        ).fetchone()
    principal, at, kept, size, digest = row
    assert principal == "erin" and at
    assert len(kept.encode()) <= 4096 and code.startswith(kept)
    assert size == len(code) and digest == hashlib.sha256(code.encode()).hexdigest()
    assert json.loads(purge[0]) == {"purge": True}  # the record of the purge outlives the data


async def test_new_work_is_refused_when_the_disk_is_below_its_floor(tmp_path: Path) -> None:
    gateway = Gateway(tmp_path / "data", _run_dir())
    gateway.start()
    try:
        token = gateway.token("frank")
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
            sid = await new_session(http, token)
        gateway.stop()  # its sandbox stays, to be re-adopted
        # A floor of the whole filesystem: the free space is always below it.
        gateway.env["KERNELHUB_STORAGE__MIN_FREE_FRACTION"] = "1"
        gateway.start()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
            r = await http.post(
                f"/v1/sessions/{sid}/executions", json={"code": "1+1", "wait": True},
                headers=auth(token),
            )  # fmt: skip
            assert r.status_code == 507, r.text
            message = r.json()["message"]
            assert "bytes free" in message and "KERNELHUB_STORAGE__MIN_FREE" in message
            assert str(db_path(gateway).parent) in message
            r = await http.post("/v1/sessions", json={}, headers=auth(token))
            assert r.status_code == 507 and r.json()["error"] == "storage_full"
            r = await http.post(f"/v1/sessions/{sid}/snapshots", headers=auth(token))
            assert r.status_code == 507 and r.json()["error"] == "storage_full"
            # Reading and deleting still work: that is how space is freed.
            assert (await http.get(f"/v1/sessions/{sid}", headers=auth(token))).status_code == 200
            r = await http.delete(
                f"/v1/sessions/{sid}", params={"purge": "true"}, headers=auth(token)
            )
            assert r.status_code == 204
    finally:
        gateway.stop()
