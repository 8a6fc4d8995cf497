"""The session core against a real gateway and real Docker sandboxes: the SDK's
executions take the WebSocket fast path with their idempotency keys (and keys keep
meaning what they mean there), and the state machine's refusals name the state and the
operation on every route."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

from kernelhub.client import AsyncHub
from tests.conftest import UNIT
from tests.gateway.conftest import Gateway

pytestmark = pytest.mark.docker


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def ws_executes(http: httpx.AsyncClient, token: str) -> dict[str, float]:
    text = (await http.get("/metrics", headers=auth(token))).text
    found = re.findall(r'^kernelhub_ws_executes_total\{path="(\w+)"\} (\S+)$', text, re.M)
    return {path: float(value) for path, value in found}


async def frames_until(ws: ClientConnection, done: Any) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    while not seen or not done(seen[-1]):
        seen.append(json.loads(await asyncio.wait_for(ws.recv(), 30 * UNIT)))
    return seen


async def test_sdk_executions_take_the_fast_path_and_keys_still_run_a_cell_once(
    shared_gateway: Gateway,
) -> None:
    gw = shared_gateway
    token = gw.token("fast")
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
        before = await ws_executes(http, token)
        async with AsyncHub(gw.url, token) as hub:
            session = await hub.create_session()
            out: list[str] = []
            for n in range(3):  # streamed: the SDK sends a fresh idempotency key each time
                done = await session.run(f"print({n} * 7)", on_stdout=out.append)
                assert done.stdout == f"{n * 7}\n"
            assert "".join(out) == "0\n7\n14\n"
            after = await ws_executes(http, token)
            assert after.get("fast", 0) - before.get("fast", 0) == 3, (before, after)
            assert after.get("queued", 0) == before.get("queued", 0), (before, after)

            # The same key twice over the fast path: one execution, which runs once.
            other = await hub.create_session()
            since = (await http.get(f"/v1/sessions/{session.id}", headers=auth(token))).json()
            url = f"{gw.ws_url}/v1/sessions/{session.id}/stream?since={since['last_seq']}"
            async with connect(url, additional_headers=auth(token)) as ws:
                assert json.loads(await ws.recv())["type"] == "hello"
                code = "counter = globals().get('counter', 0) + 1\nprint('ran', counter)"
                frame = {"type": "execute", "code": code, "idempotency_key": "k-once"}
                for request_id in ("a", "b"):
                    await ws.send(json.dumps({**frame, "request_id": request_id}))
                seen = await frames_until(
                    ws, lambda f: f.get("type") == "event" and f["event"]["type"] == "final"
                )
                accepted = [f for f in seen if f["type"] == "accepted"]
                assert [f["request_id"] for f in accepted] == ["a", "b"], seen
                assert accepted[0]["execution_id"] == accepted[1]["execution_id"]
                printed = [
                    f["event"]["text"]
                    for f in seen
                    if f["type"] == "event" and f["event"]["type"] == "stream"
                ]
                assert "".join(printed) == "ran 1\n", seen  # (one print may be two events)
            # A key used in one session is refused in another, naming the key.
            url = f"{gw.ws_url}/v1/sessions/{other.id}/stream"
            async with connect(url, additional_headers=auth(token)) as ws:
                assert json.loads(await ws.recv())["type"] == "hello"
                await ws.send(json.dumps({**frame, "request_id": "c"}))
                (error,) = await frames_until(ws, lambda f: f["type"] == "error")
                assert error["request_id"] == "c" and error["error"] == "invalid_request"
                assert "k-once" in error["message"] and "another session" in error["message"]
            check = await session.run("print(counter)")
            assert check.stdout == "1\n"
            await other.delete()  # the SDK's pool closes with its last session
            await session.delete()


async def test_refusals_name_the_current_state_and_the_attempted_operation(
    shared_gateway: Gateway,
) -> None:
    gw = shared_gateway
    token = gw.token("states")
    h = auth(token)
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
        sid = (await http.post("/v1/sessions", json={}, headers=h)).json()["id"]
        base = f"/v1/sessions/{sid}"
        r = await http.post(f"{base}/resume", headers=h)
        assert r.status_code == 409, r.text
        assert r.json()["message"].startswith(f"session {sid} is ready: cannot resume")
        r = await http.post(f"{base}/pause", headers=h)
        assert r.status_code == 200 and r.json()["state"] == "paused", r.text
        for method, path, body, operation in (
            ("POST", f"{base}/executions", {"code": "1"}, "execute"),
            ("POST", f"{base}/pause", None, "pause"),
            ("POST", f"{base}/snapshots", None, "snapshot"),
            ("POST", f"{base}/restart", None, "restart"),
        ):
            r = await http.request(method, path, json=body, headers=h)
            assert r.status_code == 409, (path, r.text)
            assert r.json()["error"] == "conflict"
            message = r.json()["message"]
            assert message.startswith(f"session {sid} is paused: cannot {operation}"), message
            assert "resume it first" in message
        r = await http.post(f"{base}/resume", headers=h)
        assert r.status_code == 200 and r.json()["state"] == "ready", r.text
        r = await http.post(f"{base}/executions", json={"code": "6 * 7", "wait": True}, headers=h)
        assert r.status_code in (200, 201) and r.json()["status"] == "completed", r.text


async def test_metadata_is_measured_in_the_bytes_it_is_stored_as(shared_gateway: Gateway) -> None:
    token = shared_gateway.token("meta")
    # 3,000 characters, 18,000 bytes of stored JSON (each é is stored as \u00e9).
    body = {"metadata": {"note": "\u00e9" * 3000}}
    async with httpx.AsyncClient(base_url=shared_gateway.url, timeout=60) as http:
        r = await http.post("/v1/sessions", json=body, headers=auth(token))
        assert r.status_code == 400 and r.json()["error"] == "invalid_request", r.text
        message = r.json()["message"]
        assert "18012 bytes" in message and "16 KiB" in message, message
        assert (await http.get("/v1/sessions", headers=auth(token))).json()["sessions"] == []
