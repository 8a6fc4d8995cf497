"""The statuses docs/protocol.md promises, from a real gateway with real sandboxes: 410 for
the caller's ended session (404 for anyone else), 415 for a body that is not JSON, a
readable 422 for malformed JSON. (The request_id echoed on a bad frame:
test_gateway.py::test_bad_websocket_frames_get_error_frames.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import docker
import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import UNIT
from tests.gateway import test_gateway
from tests.gateway.conftest import Gateway
from tests.gateway.test_gateway import auth, new_session, run

pytestmark = pytest.mark.docker
http = test_gateway.http  # the fixture: an httpx client on the gateway


async def close_code(gateway: Gateway, sid: str, token: str) -> int | None:
    with pytest.raises(ConnectionClosed) as closed:
        async with connect(
            f"{gateway.ws_url}/v1/sessions/{sid}/stream", additional_headers=auth(token)
        ) as ws:
            while True:
                await asyncio.wait_for(ws.recv(), 10 * UNIT)
    return closed.value.rcvd.code if closed.value.rcvd is not None else None


def session_routes(sid: str, execution_id: str) -> list[tuple[str, str, Any]]:
    return [
        ("GET", f"/v1/sessions/{sid}", None),
        ("DELETE", f"/v1/sessions/{sid}", None),
        ("POST", f"/v1/sessions/{sid}/executions", {"code": "1"}),
        ("POST", f"/v1/sessions/{sid}/pause", None),
        ("POST", f"/v1/sessions/{sid}/snapshots", None),
        ("GET", f"/v1/sessions/{sid}/files/a.txt", None),
        ("GET", f"/v1/sessions/{sid}/notebook", None),
        ("POST", f"/v1/executions/{execution_id}/interrupt", None),
    ]


async def test_an_ended_session_is_410_for_its_owner_and_404_for_anyone_else(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    alice, bob = gateway.token("alice"), gateway.token("bob")
    sid = await new_session(http, alice)
    done = await run(http, alice, sid, "x = 1")
    async with connect(
        f"{gateway.ws_url}/v1/sessions/{sid}/stream", additional_headers=auth(alice)
    ) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        assert (await http.delete(f"/v1/sessions/{sid}", headers=auth(alice))).status_code == 204
        with pytest.raises(ConnectionClosed) as closed:  # the open stream is told at once
            while True:
                await asyncio.wait_for(ws.recv(), 10 * UNIT)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4410
    for method, path, body in session_routes(sid, done["id"]):
        r = await http.request(method, path, json=body, headers=auth(alice))
        assert r.status_code == 410, (method, path, r.text)
        assert r.json() == {
            "error": "session_ended",
            "message": f"session {sid} was deleted; create a new session",
            "detail": None,
        }
        r = await http.request(method, path, json=body, headers=auth(bob))
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"] == "not_found"
    # The execution's record outlives its session; the stream says which case it is.
    r = await http.get(f"/v1/executions/{done['id']}", headers=auth(alice))
    assert r.status_code == 200 and r.json()["status"] == "completed"
    assert await close_code(gateway, sid, alice) == 4410
    assert await close_code(gateway, sid, bob) == 4404


async def test_a_dead_session_answers_reads_and_delete_and_refuses_work_with_410(
    make_gateway: Callable[..., Gateway],
) -> None:
    # Dead: with recovery on (the default) the gateway would bring the session back.
    gateway = make_gateway(KERNELHUB_GATEWAY__RECOVER_CRASHED="false")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
        await _dead_session_answers(gateway, http)


async def _dead_session_answers(gateway: Gateway, http: httpx.AsyncClient) -> None:
    alice = gateway.token("alice")
    sid = await new_session(http, alice)
    client = docker.from_env()
    try:
        (container,) = client.containers.list(filters={"label": f"org.kernelhub.session={sid}"})
        container.kill()
    finally:
        client.close()
    for _ in range(int(200 * UNIT)):
        info = (await http.get(f"/v1/sessions/{sid}", headers=auth(alice))).json()
        if info["state"] == "dead":
            break
        await asyncio.sleep(0.05)
    assert info["state"] == "dead" and info["reason"], info
    r = await http.post(f"/v1/sessions/{sid}/executions", json={"code": "1"}, headers=auth(alice))
    assert r.status_code == 410 and r.json()["error"] == "session_ended", r.text
    assert r.json()["message"].startswith(f"session {sid} has ended (")
    assert (await http.post(f"/v1/sessions/{sid}/pause", headers=auth(alice))).status_code == 410
    # A restarted gateway no longer holds it: it still reads as dead, and can be removed.
    gateway.stop()
    gateway.start()
    info = (await http.get(f"/v1/sessions/{sid}", headers=auth(alice))).json()
    assert info["state"] == "dead", info
    r = await http.post(f"/v1/sessions/{sid}/executions", json={"code": "1"}, headers=auth(alice))
    assert r.status_code == 410, r.text
    assert await close_code(gateway, sid, alice) == 4410
    assert (await http.delete(f"/v1/sessions/{sid}", headers=auth(alice))).status_code == 204
    assert (await http.get(f"/v1/sessions/{sid}", headers=auth(alice))).status_code == 410
    assert (await http.delete(f"/v1/sessions/{sid}", headers=auth(alice))).status_code == 410
    listed = (await http.get("/v1/sessions", headers=auth(alice))).json()["sessions"]
    assert sid not in [s["id"] for s in listed]


async def test_unreadable_bodies_are_415_and_a_readable_422(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    path = f"/v1/sessions/{sid}/executions"
    r = await http.post(path, data={"code": "print(1)"}, headers=auth(token))
    assert r.status_code == 415, r.text
    assert r.json()["error"] == "unsupported_media_type"
    assert r.json()["message"].startswith("send application/json")
    bad = '{"code": "1" "wait": true}'
    r = await http.post(
        path, content=bad, headers={**auth(token), "Content-Type": "application/json"}
    )
    assert r.status_code == 422, r.text
    assert r.json()["message"] == (
        "request body is not valid JSON: Expecting ',' delimiter at line 1 column 14"
    )
    # Nothing ran: the session's only execution is the one that follows.
    assert (await run(http, token, sid, "1 + 1"))["record"]["execution_count"] == 1
