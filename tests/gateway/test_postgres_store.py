"""The gateway on the PostgreSQL store end to end: a real gateway process with
``KERNELHUB_STORE__URL`` pointing at the run's private PostgreSQL server, real Docker
sandboxes. Create, execute (REST and WebSocket), kill -9 the gateway, and on a new
process replay every event gap-free and export the notebook: all of it from PostgreSQL,
with no SQLite file ever made."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.conftest import UNIT
from tests.gateway.conftest import Gateway, gateway_run_dir, remove_sandboxes
from tests.postgres import PostgresCluster

pytestmark = [pytest.mark.docker, pytest.mark.postgres]


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def replay(gw: Gateway, token: str, sid: str) -> list[dict[str, Any]]:
    """Every stored event of the session, from seq 0, until the last known one."""
    events: list[dict[str, Any]] = []
    url = f"{gw.ws_url}/v1/sessions/{sid}/stream?since=0"
    async with connect(url, additional_headers=auth(token)) as ws:
        hello = json.loads(await ws.recv())
        assert hello["type"] == "hello"
        while not events or events[-1]["seq"] < hello["last_seq"]:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 30 * UNIT))
            if frame["type"] == "event":
                events.append(frame["event"])
    return events


async def test_a_session_lives_in_postgres_across_a_gateway_crash(
    postgres_cluster: PostgresCluster, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    gw = Gateway(data, gateway_run_dir(), KERNELHUB_STORE__URL=postgres_cluster.fresh_url())
    token = gw.token("alice")
    gw.start()
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
            r = await http.post("/v1/sessions", json={}, headers=auth(token))
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            r = await http.post(f"/v1/sessions/{sid}/executions", headers=auth(token),
                                json={"code": "x = 6 * 7\nprint('rest', x)", "wait": True})  # fmt: skip
            assert r.status_code == 200 and r.json()["record"]["status"] == "completed", r.text
            url = f"{gw.ws_url}/v1/sessions/{sid}/stream"
            async with connect(url, additional_headers=auth(token)) as ws:
                assert json.loads(await ws.recv())["type"] == "hello"
                code = "for i in range(300):\n    print('line', i)"
                await ws.send(json.dumps({"type": "execute", "code": code, "request_id": "r"}))
                ours = None
                while True:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 60 * UNIT))
                    if frame["type"] == "accepted":
                        ours = frame["execution_id"]
                    elif frame["type"] == "event":
                        event = frame["event"]  # the stream replays the REST cell's too
                        if (event["type"], event["execution_id"]) == ("final", ours):
                            break
        live = await replay(gw, token, sid)
        gw.kill9()
        gw.start()  # a new process: everything it knows comes from PostgreSQL
        again = await replay(gw, token, sid)
        seqs = [e["seq"] for e in again]
        # Increasing, each once. Not consecutive: kernelhub's own silent calls (the checkpoint
        # after each cell, on by default) take numbers no client is shown.
        assert seqs == sorted(set(seqs)), seqs
        assert again == live
        text = "".join(e.get("text", "") for e in again if e["type"] == "stream")
        assert "rest 42" in text and "line 299" in text
        async with httpx.AsyncClient(base_url=gw.url, timeout=60 * UNIT) as http:
            r = await http.get(f"/v1/sessions/{sid}/notebook", headers=auth(token))
            assert r.status_code == 200, r.text
            cells = [c for c in r.json()["cells"] if c["cell_type"] == "code"]
            sources = ["".join(c["source"]) for c in cells]
            assert sources == ["x = 6 * 7\nprint('rest', x)", code]
        assert not (data / "kernelhub.sqlite3").exists()
    finally:
        gw.stop()
        remove_sandboxes()
