"""The gateway end to end over real HTTP and WebSocket, real uvicorn, real Docker."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import UNIT
from tests.gateway.conftest import Gateway

pytestmark = pytest.mark.docker


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def new_session(http: httpx.AsyncClient, token: str, **body: Any) -> str:
    r = await http.post("/v1/sessions", json=body, headers=auth(token))
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def run(
    http: httpx.AsyncClient, token: str, sid: str, code: str, **extra: Any
) -> dict[str, Any]:
    r = await http.post(
        f"/v1/sessions/{sid}/executions",
        json={"code": code, "wait": True, **extra},
        headers=auth(token),
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def stdout(execution: dict[str, Any]) -> str:
    return "".join(
        e["text"] for e in execution["events"] if e["type"] == "stream" and e["name"] == "stdout"
    )


@pytest.fixture
async def http(gateway: Gateway) -> Any:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as client:
        yield client


async def test_state_persists_and_openapi_is_served(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token, metadata={"purpose": "test"})
    await run(http, token, sid, "x = 41")
    result = await run(http, token, sid, "print(x + 1)")
    assert stdout(result) == "42\n" and result["status"] == "completed"
    spec = (await http.get("/openapi.json")).json()
    assert "/v1/sessions/{session_id}/executions" in spec["paths"]
    assert (await http.get("/healthz")).status_code == 200
    metrics = (await http.get("/metrics", headers=auth(token))).text
    assert 'kernelhub_executions_total{status="completed"}' in metrics
    assert "kernelhub_sessions" in metrics and "kernelhub_session_start_seconds" in metrics


async def test_two_principals_cannot_see_each_other(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    alice, bob = gateway.token("alice"), gateway.token("bob")
    sid = await new_session(http, alice)
    execution = await run(http, alice, sid, "secret = 1")
    for method, path in [
        ("GET", f"/v1/sessions/{sid}"),
        ("DELETE", f"/v1/sessions/{sid}"),
        ("POST", f"/v1/sessions/{sid}/executions"),
        ("GET", f"/v1/executions/{execution['id']}"),
        ("POST", f"/v1/executions/{execution['id']}/interrupt"),
    ]:
        body = {"code": "secret"} if method == "POST" and path.endswith("executions") else None
        r = await http.request(method, path, json=body, headers=auth(bob))
        assert r.status_code == 404, (method, path, r.text)
    listed = (await http.get("/v1/sessions", headers=auth(bob))).json()["sessions"]
    assert listed == []
    with pytest.raises(ConnectionClosed) as closed:
        async with connect(
            f"{gateway.ws_url}/v1/sessions/{sid}/stream", additional_headers=auth(bob)
        ) as ws:
            await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404
    assert (await http.get("/v1/admin/sessions", headers=auth(alice))).status_code == 403
    admin = gateway.token("root", admin=True)
    everyone = (await http.get("/v1/admin/sessions", headers=auth(admin))).json()["sessions"]
    assert [s["id"] for s in everyone] == [sid]


async def test_idempotent_retry_runs_once(gateway: Gateway, http: httpx.AsyncClient) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    code = "n = globals().get('n', 0) + 1\nn"
    first, second = await asyncio.gather(
        run(http, token, sid, code, idempotency_key="k-1"),
        run(http, token, sid, code, idempotency_key="k-1"),
    )
    assert first["id"] == second["id"]
    again = await run(http, token, sid, code, idempotency_key="k-1")
    assert again["id"] == first["id"]
    check = await run(http, token, sid, "print(n)")
    assert stdout(check) == "1\n"


async def test_async_execution_poll_interrupt_and_cancel(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    r = await http.post(
        f"/v1/sessions/{sid}/executions",
        json={"code": "import time; time.sleep(60)"},
        headers=auth(token),
    )
    assert r.status_code == 202 and r.json()["status"] in ("queued", "running")
    long_id = r.json()["id"]
    r = await http.post(f"/v1/sessions/{sid}/executions", json={"code": "1"}, headers=auth(token))
    queued_id = r.json()["id"]
    r = await http.post(f"/v1/executions/{queued_id}/cancel", headers=auth(token))
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    for _ in range(100):
        if (await http.get(f"/v1/executions/{long_id}", headers=auth(token))).json()[
            "status"
        ] == "running":
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    r = await http.post(f"/v1/executions/{long_id}/interrupt", headers=auth(token))
    assert r.status_code == 202, r.text
    for _ in range(100):
        info = (await http.get(f"/v1/executions/{long_id}", headers=auth(token))).json()
        if info["record"]:
            break
        await asyncio.sleep(0.05)
    assert info["status"] == "interrupted" and info["events"][-1]["type"] == "final"
    r = await http.post(f"/v1/executions/{long_id}/cancel", headers=auth(token))
    assert r.status_code == 409 and "queued" in r.json()["message"]


async def test_input_is_answered_over_rest(gateway: Gateway, http: httpx.AsyncClient) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    r = await http.post(
        f"/v1/sessions/{sid}/executions",
        json={"code": "print('got', input('? '))"},
        headers=auth(token),
    )
    eid = r.json()["id"]
    for _ in range(200):
        if (await http.get(f"/v1/executions/{eid}", headers=auth(token))).json()[
            "status"
        ] == "awaiting_input":
            break
        await asyncio.sleep(0.05)
    r = await http.post(f"/v1/executions/{eid}/input", json={"value": "yes"}, headers=auth(token))
    assert r.status_code == 202, r.text
    for _ in range(200):
        info = (await http.get(f"/v1/executions/{eid}", headers=auth(token))).json()
        if info["record"]:
            break
        await asyncio.sleep(0.05)
    assert stdout(info).endswith("got yes\n")


async def test_counting_transcript_survives_20_reconnects(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    url = f"{gateway.ws_url}/v1/sessions/{sid}/stream"
    seen: dict[int, dict[str, Any]] = {}
    last = 0
    execution_id = None
    finals = 0
    async with connect(f"{url}?since=0", additional_headers=auth(token)) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        code = "import time\nfor i in range(20000):\n    print(i)\n    if i % 200 == 0:\n        time.sleep(0.02)"
        await ws.send(json.dumps({"type": "execute", "code": code, "request_id": "r1"}))
    reconnects = 0
    done = False
    while not done:
        async with connect(f"{url}?since={last}", additional_headers=auth(token)) as ws:
            reconnects += 1
            budget = random.randint(1, 4)  # frames to read before dropping the connection
            while budget > 0 or reconnects > 20:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 60 * UNIT))
                if frame["type"] == "accepted":
                    execution_id = frame["execution_id"]
                if frame["type"] != "event":
                    continue
                event = frame["event"]
                assert event["seq"] > last, "duplicate or out-of-order event"
                seen[event["seq"]] = event
                last = event["seq"]
                budget -= 1
                if event["type"] == "final":
                    finals += 1
                    done = True
                    break
    assert reconnects > 20
    assert finals == 1
    assert sorted(seen) == list(range(1, last + 1)), "gap in the sequence"
    text = "".join(e["text"] for e in seen.values() if e["type"] == "stream")
    assert text == "".join(f"{i}\n" for i in range(20000))
    assert execution_id is None or all(e["execution_id"] == execution_id for e in seen.values())


async def test_disconnecting_client_does_not_stop_the_cell(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    url = f"{gateway.ws_url}/v1/sessions/{sid}/stream"
    async with connect(url, additional_headers=auth(token)) as ws:
        await ws.recv()
        await ws.send(
            json.dumps(
                {
                    "type": "execute",
                    "code": "import time\nfor i in range(5):\n    print(i, flush=True)\n    time.sleep(0.2)",
                    "request_id": "a",
                }
            )
        )
        while json.loads(await ws.recv())["type"] != "accepted":
            pass
    # Gone mid-cell. The cell finishes and its output is stored.
    for _ in range(100):
        sessions = (await http.get(f"/v1/sessions/{sid}", headers=auth(token))).json()
        if sessions["state"] == "ready":
            break
        await asyncio.sleep(0.1)
    async with connect(f"{url}?since=0", additional_headers=auth(token)) as ws:
        events = []
        while not events or events[-1]["type"] != "final":
            frame = json.loads(await ws.recv())
            if frame["type"] == "event":
                events.append(frame["event"])
    assert "".join(e["text"] for e in events if e["type"] == "stream") == "0\n1\n2\n3\n4\n"


async def test_a_result_waits_for_its_final_only_briefly(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    """A cell's `result` may wait for its `final` to share a write (``coalesce_window``),
    but a final that is late (a slow post-execute hook here) does not keep it back."""
    token = gateway.token("alice")
    sid = await new_session(http, token)
    await run(
        http, token, sid,
        "import time\nget_ipython().events.register('post_execute', lambda: time.sleep(1.5))",
    )  # fmt: skip
    url = f"{gateway.ws_url}/v1/sessions/{sid}/stream"
    async with connect(url, additional_headers=auth(token)) as ws:
        seen = json.loads(await ws.recv())["last_seq"]  # hello: the first cell is replayed
        await ws.send(json.dumps({"type": "execute", "code": "40 + 2", "request_id": "a"}))
        arrived: dict[str, float] = {}
        while "final" not in arrived:
            frame = json.loads(await ws.recv())
            if frame["type"] == "event" and frame["event"]["seq"] > seen:
                arrived[frame["event"]["type"]] = asyncio.get_running_loop().time()
    assert arrived["final"] - arrived["result"] > 1.0
    assert arrived["final"] - arrived["status"] > 1.0  # `running`, like `accepted`, too


async def test_kill_9_and_restart_keeps_variables_and_history(gateway: Gateway) -> None:
    token = gateway.token("alice")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60 * UNIT) as http:
        sid = await new_session(http, token)
        first = await run(
            http, token, sid, "import numpy as np\nkept = np.arange(5)\nprint('before')"
        )
    gateway.kill9()
    gateway.start()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60 * UNIT) as http:
        old = (await http.get(f"/v1/executions/{first['id']}", headers=auth(token))).json()
        assert stdout(old) == "before\n"
        info = (await http.get(f"/v1/sessions/{sid}", headers=auth(token))).json()
        assert info["state"] == "ready", info
        after = await run(http, token, sid, "print(kept.sum())")
        assert stdout(after) == "10\n"
        events = [e["seq"] for e in after["events"]]
        assert min(events) > max(e["seq"] for e in old["events"])


def _stalled_client(port: int, path: str, token: str) -> socket.socket:
    """A WebSocket client that completes the handshake and then never reads: tiny receive
    buffer, no library buffering behind our back."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            f"Authorization: Bearer {token}\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _close_code(data: bytes) -> int | None:
    """Walk the server's (unmasked) frames; the code of the close frame, if any."""
    i = 0
    while i + 2 <= len(data):
        opcode, size = data[i] & 0x0F, data[i + 1] & 0x7F
        i += 2
        if size == 126:
            size, i = int.from_bytes(data[i : i + 2], "big"), i + 2
        elif size == 127:
            size, i = int.from_bytes(data[i : i + 8], "big"), i + 8
        if opcode == 8:
            return int.from_bytes(data[i : i + 2], "big")
        i += size
    return None


async def test_client_that_never_reads_is_cut_off_and_memory_stays_bounded(tmp_path: Any) -> None:
    gw = Gateway(
        tmp_path / "data", _run_dir(), KERNELHUB_GATEWAY__STREAM_STALL_TIMEOUT=str(3 * UNIT)
    )
    gw.start()
    try:
        token = gw.token("alice")
        async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
            sid = await new_session(
                http, token, limits={"output_bytes": 100 * 2**20, "memory_bytes": 2**31}
            )
            rss_before = gw.rss()
            sock = await asyncio.to_thread(
                _stalled_client, gw.port, f"/v1/sessions/{sid}/stream", token
            )
            try:
                code = (
                    "import sys\nfor i in range(900):\n    sys.stdout.write('y' * 100_000 + '\\n')"
                )
                r = await http.post(
                    f"/v1/sessions/{sid}/executions", json={"code": code}, headers=auth(token)
                )
                eid = r.json()["id"]
                for _ in range(1200):  # poll without outputs: only the stream carries them
                    info = (
                        await http.get(f"/v1/executions/{eid}?events=false", headers=auth(token))
                    ).json()
                    if info["record"]:
                        break
                    await asyncio.sleep(0.05)
                assert info["status"] == "completed"
                assert info["record"]["output_bytes"] > 85 * 2**20
                await asyncio.sleep(4 * UNIT)  # past the stall timeout
                growth = gw.rss() - rss_before
                assert growth < 100 * 2**20, (
                    f"gateway RSS grew {growth / 2**20:.0f} MiB for 90 MB of output"
                )
                # Now read what the gateway queued for us: it ends with the 4408 close frame.
                sock.settimeout(30 * UNIT)
                data = bytearray()
                while chunk := await asyncio.to_thread(sock.recv, 1 << 20):
                    data += chunk
                    if _close_code(bytes(data[-64:])) is not None or len(data) > 2**28:
                        break
                assert _close_code(bytes(data)) == 4408
            finally:
                sock.close()
            assert (await http.get("/healthz")).status_code == 200
    finally:
        gw.stop()


async def test_a_reader_slower_than_the_kernel_catches_up_without_loss(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token, limits={"output_bytes": 64 * 2**20})
    async with connect(
        f"{gateway.ws_url}/v1/sessions/{sid}/stream", additional_headers=auth(token), max_size=2**24
    ) as ws:
        await ws.recv()
        code = "import sys\nfor i in range(300):\n    sys.stdout.write(f'{i:06d}' + 'z' * 100_000 + '\\n')"
        await ws.send(json.dumps({"type": "execute", "code": code}))
        text, seqs = [], []
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60 * UNIT))
            if frame["type"] != "event":
                continue
            seqs.append(frame["event"]["seq"])
            if frame["event"]["type"] == "stream":
                text.append(frame["event"]["text"])
                await asyncio.sleep(0.01)  # a slow consumer, well over the 8 MiB buffer behind
            if frame["event"]["type"] == "final":
                break
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "gap or duplicate"
    lines = "".join(text).splitlines()
    assert [int(line[:6]) for line in lines] == list(range(300))


def _run_dir() -> Any:
    import os
    from pathlib import Path

    return Path("/run/kernelhub-test") if os.geteuid() == 0 else Path("/tmp/khrun")


async def test_bad_requests_get_clear_4xx_and_the_gateway_keeps_serving(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    h = auth(token)
    cases: list[tuple[str, str, Any, dict[str, str]]] = [
        ("POST", "/v1/sessions", "{not json", {}),
        ("POST", "/v1/sessions", {"limits": {"memory_bytes": "lots"}}, {}),
        ("POST", "/v1/sessions", {"unknown": 1}, {}),
        ("POST", "/v1/sessions", {"limits": {"memory_bytes": 10**15}}, {}),
        ("POST", f"/v1/sessions/{sid}/executions", {"code": 5}, {}),
        ("POST", f"/v1/sessions/{sid}/executions", {"code": "1", "timeout": -1}, {}),
        ("POST", f"/v1/sessions/{sid}/executions", {"code": "x" * 3_000_000}, {}),
        ("POST", "/v1/sessions/nope/executions", {"code": "1"}, {}),
        ("GET", "/v1/executions/nope", None, {}),
        ("GET", "/v1/sessions", None, {"Authorization": "Bearer wrong"}),
        ("GET", "/v1/sessions", None, {"Authorization": "Basic x"}),
        ("DELETE", "/v1/sessions", None, {}),
    ]
    rng = random.Random(7)
    for _ in range(40):  # plus random junk bodies
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        cases.append(
            ("POST", rng.choice(["/v1/sessions", f"/v1/sessions/{sid}/executions"]), junk, {})
        )
    for method, path, body, headers in cases:
        kwargs: dict[str, Any] = {"headers": {**h, **headers}}
        if isinstance(body, (dict, list)):
            kwargs["json"] = body
        elif body is not None:
            kwargs["content"] = body if isinstance(body, bytes) else body.encode()
            kwargs["headers"]["content-type"] = "application/json"
        r = await http.request(method, path, **kwargs)
        assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text[:200])
        payload = r.json()
        assert payload["error"] and payload["message"], payload
        assert "Traceback" not in r.text
    # A deleted session refuses work with 410 Gone, and the gateway still serves.
    assert (await http.delete(f"/v1/sessions/{sid}", headers=h)).status_code == 204
    r = await http.post(f"/v1/sessions/{sid}/executions", json={"code": "1"}, headers=h)
    assert r.status_code == 410 and r.json()["error"] == "session_ended"
    sid2 = await new_session(http, token)
    assert stdout(await run(http, token, sid2, "print('alive')")) == "alive\n"


async def test_bad_websocket_frames_get_error_frames(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    async with connect(
        f"{gateway.ws_url}/v1/sessions/{sid}/stream", additional_headers=auth(token)
    ) as ws:
        await ws.recv()
        # Each answer names the frame it answers, read leniently from the frame itself.
        for bad, request_id in [
            ("not json", None),
            (json.dumps({"type": "nope", "request_id": "r-type"}), "r-type"),
            (json.dumps({"type": "execute", "request_id": "r-code"}), "r-code"),
            (json.dumps({"type": "execute", "code": "1", "extra": 1, "request_id": "r-x"}), "r-x"),
            (json.dumps({"type": "execute", "code": "1", "timeout": -1, "request_id": 7}), None),
            (json.dumps({"type": "input_reply", "execution_id": "x", "value": "v"}), None),
        ]:
            await ws.send(bad)
            frame = json.loads(await ws.recv())
            assert frame["type"] == "error" and frame["message"], frame
            assert frame["request_id"] == request_id, frame
        await ws.send(
            json.dumps({"type": "execute", "code": "1", "timeout": -1, "request_id": "r1"})
        )
        frame = json.loads(await ws.recv())
        assert frame == {
            "type": "error",
            "request_id": "r1",
            "error": "invalid_frame",
            "message": "fix the frame: execute.timeout: Input should be greater than 0",
        }
        await ws.send(json.dumps({"type": "ping", "request_id": "p"}))
        assert json.loads(await ws.recv()) == {"type": "pong", "request_id": "p"}


async def test_quota_answers_429_with_retry_after(tmp_path: Any) -> None:
    gw = Gateway(tmp_path / "data", _run_dir(), KERNELHUB_GATEWAY__MAX_SESSIONS_PER_PRINCIPAL="1")
    gw.start()
    try:
        token = gw.token(f"u{uuid.uuid4().hex[:6]}")
        async with httpx.AsyncClient(base_url=gw.url, timeout=60 * UNIT) as http:
            await new_session(http, token)
            r = await http.post("/v1/sessions", json={}, headers=auth(token))
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert "delete one" in r.json()["message"]
    finally:
        gw.stop()


async def test_files_upload_download_over_http(gateway: Gateway, http: httpx.AsyncClient) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    h = auth(token)
    payload = bytes(range(256)) * 4096  # 1 MiB

    async def body() -> Any:
        for i in range(0, len(payload), 65536):
            yield payload[i : i + 65536]

    r = await http.put(f"/v1/sessions/{sid}/files/in/data.bin", content=body(), headers=h)
    assert r.status_code == 201 and r.json()["size"] == len(payload), r.text
    check = await run(http, token, sid, "print(len(open('in/data.bin','rb').read()))")
    assert stdout(check) == f"{len(payload)}\n"
    r = await http.get(f"/v1/sessions/{sid}/files/in/data.bin", headers=h)
    assert r.status_code == 200 and r.content == payload
    await run(http, token, sid, "import os\nos.symlink('/etc/passwd', 'evil')")
    assert (await http.get(f"/v1/sessions/{sid}/files/evil", headers=h)).status_code == 400
    assert (await http.get(f"/v1/sessions/{sid}/files/nope.txt", headers=h)).status_code == 404
    r = await http.put(f"/v1/sessions/{sid}/files/..%2Fescape", content=b"x", headers=h)
    assert r.status_code in (400, 404), r.text
    bob = gateway.token("bob")
    assert (
        await http.get(f"/v1/sessions/{sid}/files/in/data.bin", headers=auth(bob))
    ).status_code == 404


async def test_pause_and_resume_through_the_api(gateway: Gateway, http: httpx.AsyncClient) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    h = auth(token)
    # The cell sleeps longer than its timeout allows *running*; the paused time is free.
    r = await http.post(
        f"/v1/sessions/{sid}/executions",
        json={"code": "import time\ntime.sleep(4)\nprint('woke')", "timeout": 3.5},
        headers=h,
    )
    eid = r.json()["id"]
    await asyncio.sleep(1.0)
    r = await http.post(f"/v1/sessions/{sid}/pause", headers=h)
    assert r.status_code == 200 and r.json()["state"] == "paused", r.text
    assert (await http.get(f"/v1/executions/{eid}", headers=h)).json()["status"] == "paused"
    r = await http.post(f"/v1/sessions/{sid}/executions", json={"code": "1"}, headers=h)
    assert r.status_code == 409 and "resume" in r.json()["message"]
    r = await http.post(f"/v1/executions/{eid}/interrupt", headers=h)
    assert r.status_code == 409
    await asyncio.sleep(2.5)
    r = await http.post(f"/v1/sessions/{sid}/resume", headers=h)
    assert r.status_code == 200 and r.json()["state"] in ("busy", "ready")
    for _ in range(200):
        info = (await http.get(f"/v1/executions/{eid}", headers=h)).json()
        if info["record"]:
            break
        await asyncio.sleep(0.05)
    assert info["status"] == "completed", info["record"]
    assert info["record"]["paused_seconds"] >= 2.5
    assert stdout(info) == "woke\n"
    admin = gateway.token("root", admin=True)
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        assert (await c.post("/v1/admin/stop-all", headers=auth(admin))).json()["stopped"] == 1


async def test_cli_exec_streams_and_sessions_ls_rm(gateway: Gateway) -> None:
    token = gateway.token("alice")
    env = {**gateway.env, "KERNELHUB_URL": gateway.url, "KERNELHUB_TOKEN": token}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kernelhub.cli", "exec", "-",
        env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(
        proc.communicate(b"for i in range(3):\n    print('line', i)\n"), 60 * UNIT
    )
    assert proc.returncode == 0, err.decode()
    assert "line 0\nline 1\nline 2\n" in out.decode()
    failing = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kernelhub.cli", "exec", "1/0", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(failing.communicate(), 60 * UNIT)
    assert failing.returncode == 1 and "ZeroDivisionError" in out.decode()
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        sid = await new_session(http, token)
    listed = subprocess.run(
        [sys.executable, "-m", "kernelhub.cli", "sessions", "ls"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert sid in listed.stdout
    subprocess.run(
        [sys.executable, "-m", "kernelhub.cli", "sessions", "rm", sid],
        env=env,
        check=True,
        capture_output=True,
    )
    listed = subprocess.run(
        [sys.executable, "-m", "kernelhub.cli", "sessions", "ls"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert sid not in listed.stdout


async def test_sdk_against_the_real_gateway(gateway: Gateway) -> None:
    from kernelhub.client import AsyncHub

    token = gateway.token("alice")
    async with AsyncHub(gateway.url, token) as hub:
        session = await hub.create_session()
        await session.run("x = 1")
        lines: list[str] = []
        result = await session.run("for i in range(3): print(x + i)", on_stdout=lines.append)
        assert "".join(lines) == "1\n2\n3\n" and result.status.value == "completed"
        await session.upload("notes.txt", b"hello")
        assert await session.download("notes.txt") == b"hello"
        answered = await session.run("print(confirm('go?'))", on_input=lambda prompt: "y")
        assert answered.stdout.strip() == "True"
        await session.delete()


async def test_snapshot_and_restore_into_a_fresh_sandbox(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    h = auth(token)
    sid = await new_session(http, token)
    setup = (
        "import numpy as np, pandas as pd, threading\n"
        "arr = np.arange(10)\n"
        "df = pd.DataFrame({'a': [1, 2, 3]})\n"
        "def double(x):\n    return 2 * x\n"
        "class Point:\n    def __init__(self, x):\n        self.x = x\n"
        "p = Point(3)\n"
        "square = lambda v: v * v\n"
        "def make_adder(n):\n    return lambda v: v + n\n"
        "add5 = make_adder(5)\n"
        "lock = threading.Lock()\n"
        "gen = (i for i in range(3))\n"
        "open('notes.txt', 'w').write('kept')\n"
    )
    assert (await run(http, token, sid, setup))["status"] == "completed"
    r = await http.post(f"/v1/sessions/{sid}/snapshots", headers=h)
    assert r.status_code == 201, r.text
    snap = r.json()
    assert {"arr", "df", "double", "Point", "p", "square", "add5"} <= set(snap["saved"])
    assert "gen" in snap["skipped"] and snap["skipped"]["gen"]
    r = await http.post("/v1/sessions", json={"from_snapshot": snap["id"]}, headers=h)
    assert r.status_code == 201, r.text
    restored = r.json()
    assert restored["restore"]["failed"] == {}
    check = await run(
        http, token, restored["id"],
        "print(arr.sum(), df.a.sum(), double(4), isinstance(p, Point), p.x, square(3), add5(1),"
        " open('notes.txt').read())",
    )  # fmt: skip
    assert stdout(check) == "45 6 8 True 3 9 6 kept\n", check
    assert check["record"]["execution_count"] == 2  # continues after the one cell before
    # Someone else cannot restore it; a blob edited on disk is refused before any sandbox.
    bob = gateway.token("bob")
    r = await http.post("/v1/sessions", json={"from_snapshot": snap["id"]}, headers=auth(bob))
    assert r.status_code == 404
    blob = next((Path(gateway.env["KERNELHUB_DATA_DIR"]) / "snapshots").glob(f"{snap['id']}.blob"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    r = await http.post("/v1/sessions", json={"from_snapshot": snap["id"]}, headers=h)
    assert r.status_code == 400 and "integrity" in r.json()["message"]


async def test_a_snapshot_that_runs_code_when_unpickled_never_runs_it_on_the_host(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    h = auth(token)
    marker = Path(f"/tmp/kernelhub-pwned-{uuid.uuid4().hex}")
    sid = await new_session(http, token)
    # Hostile code in the sandbox makes an object whose unpickling runs a command.
    hostile = (
        "import os\n"
        "class Evil:\n"
        f"    def __reduce__(self):\n        return (os.system, ('touch {marker}',))\n"
        "evil = Evil()\n"
    )
    await run(http, token, sid, hostile)
    snap = (await http.post(f"/v1/sessions/{sid}/snapshots", headers=h)).json()
    r = await http.post("/v1/sessions", json={"from_snapshot": snap["id"]}, headers=h)
    assert r.status_code == 201
    # It ran, if at all, inside the new sandbox — whose /tmp is not the host's.
    assert not marker.exists()
    inside = await run(
        http, token, r.json()["id"], f"import os\nprint(os.path.exists({str(marker)!r}))"
    )
    assert stdout(inside) in ("True\n", "False\n")
    assert not marker.exists()


async def test_audit_log_records_who_did_what(gateway: Gateway, http: httpx.AsyncClient) -> None:
    import sqlite3

    token = gateway.token("alice")
    sid = await new_session(http, token)
    await run(http, token, sid, "print('audited')")
    r = await http.post(
        f"/v1/sessions/{sid}/executions", json={"code": "input('ok? ')"}, headers=auth(token)
    )
    eid = r.json()["id"]
    for _ in range(200):
        if (await http.get(f"/v1/executions/{eid}?events=false", headers=auth(token))).json()[
            "status"
        ] == "awaiting_input":
            break
        await asyncio.sleep(0.05)
    await http.post(f"/v1/executions/{eid}/input", json={"value": "sure"}, headers=auth(token))
    await http.delete(f"/v1/sessions/{sid}", headers=auth(token))
    db = sqlite3.connect(Path(gateway.env["KERNELHUB_DATA_DIR"]) / "kernelhub.sqlite3")
    rows = db.execute(
        "SELECT principal, action, code, status, duration, cpu_seconds, peak_memory_bytes, output_bytes, client, detail FROM audit WHERE session_id = ? ORDER BY id",
        (sid,),
    ).fetchall()
    db.close()
    actions = [r[1] for r in rows]
    assert actions[0] == "session.create" and actions[-1] == "session.delete"
    executed = next(r for r in rows if r[1] == "execution" and r[2] == "print('audited')")
    principal, _, _, status, duration, cpu, peak, out_bytes, client, _ = executed
    assert principal == "alice" and status == "completed" and duration > 0
    assert cpu is not None and peak is not None and out_bytes == len("audited\n")
    assert client and client.startswith("127.0.0.1:")
    answered = next(r for r in rows if r[1] == "execution.input")
    assert answered[0] == "alice" and '"sure"' in answered[9]


async def test_idle_session_hibernates_and_wakes_transparently(tmp_path: Any) -> None:
    import docker

    gw = Gateway(tmp_path / "data", _run_dir(), KERNELHUB_GATEWAY__HIBERNATE_AFTER=str(2 * UNIT))
    gw.start()
    try:
        token = gw.token("alice")
        h = auth(token)
        async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
            sid = await new_session(http, token)
            await run(http, token, sid, "x = 41\nopen('kept.txt', 'w').write('file')")
            label = {"label": f"org.kernelhub.session={sid}"}
            client = docker.from_env()
            (awake,) = client.containers.list(all=True, filters=label)
            client.close()
            for _ in range(200):
                info = (await http.get(f"/v1/sessions/{sid}", headers=h)).json()
                if info["state"] == "hibernated":
                    break
                await asyncio.sleep(0.1)
            assert info["state"] == "hibernated", info
            listed = (await http.get("/v1/sessions", headers=h)).json()["sessions"]
            assert [s["state"] for s in listed if s["id"] == sid] == ["hibernated"]
            # Its sandbox is gone; at most a fresh, empty standby one waits for the wake.
            client = docker.from_env()
            left = client.containers.list(all=True, filters=label)
            assert len(left) <= 1 and awake.id not in [c.id for c in left], left
            client.close()
            woke = await run(http, token, sid, "print(x + 1, open('kept.txt').read())")
            assert stdout(woke) == "42 file\n"
            assert (await http.get(f"/v1/sessions/{sid}", headers=h)).json()["state"] in (
                "ready",
                "busy",
            )
            assert (await http.get("/v1/snapshots", headers=h)).json()["snapshots"] == []
    finally:
        gw.stop()


async def test_checkpoints_let_a_failed_step_be_retried_from_before_it(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    h = auth(token)
    r = await http.post("/v1/sessions", json={"checkpoints": "every_cell"}, headers=h)
    sid = r.json()["id"]
    await run(http, token, sid, "import pandas as pd\ndf = pd.DataFrame({'v': range(5)})")  # cell 1
    await run(http, token, sid, "df['v'] = df['v'] * 10\nstep = 2")  # cell 2
    bad = await run(
        http, token, sid, "df = df.drop(columns=['v'])\nstep = 3\n1 / 0"
    )  # cell 3 fails
    assert bad["status"] == "failed"
    r = await http.post(f"/v1/sessions/{sid}/rewind", json={"before_cell": 3}, headers=h)
    assert r.status_code == 200, r.text
    assert r.json()["checkpoint_after_cell"] == 2 and r.json()["failed"] == {}
    after = await run(http, token, sid, "print(list(df['v']), step)")
    assert stdout(after) == "[0, 10, 20, 30, 40] 2\n"
    r = await http.post(f"/v1/sessions/{sid}/rewind", json={"before_cell": 2}, headers=h)
    assert r.status_code == 200 and r.json()["checkpoint_after_cell"] == 1
    again = await run(http, token, sid, "print(list(df['v']), 'step' in globals())")
    assert stdout(again) == "[0, 1, 2, 3, 4] False\n"
    # A session without checkpoints says how to get them.
    plain = await new_session(http, token, checkpoints="off")
    await run(http, token, plain, "x = 1")
    r = await http.post(f"/v1/sessions/{plain}/rewind", json={"before_cell": 2}, headers=h)
    assert r.status_code == 409 and "checkpoints" in r.json()["message"]


async def test_a_crashed_kernel_comes_back_from_its_last_checkpoint(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    h = auth(token)
    body = {"checkpoints": "every_cell", "limits": {"memory_bytes": 256 * 2**20}}
    sid = (await http.post("/v1/sessions", json=body, headers=h)).json()["id"]
    await run(http, token, sid, "import numpy as np\nkept = np.arange(10)")
    await run(http, token, sid, "also = {'a': 1}")
    bomb = await run(
        http,
        token,
        sid,
        "blocks = []\nwhile True:\n    blocks.append(bytearray(32 * 2**20))",
        timeout=60,
    )
    assert bomb["status"] == "kernel_died" and "out of memory" in bomb["record"]["reason"]
    for _ in range(300):
        info = (await http.get(f"/v1/sessions/{sid}", headers=h)).json()
        if info["state"] == "ready":
            break
        await asyncio.sleep(0.1)
    assert info["state"] == "ready", info
    after = await run(http, token, sid, "print(int(kept.sum()), also['a'], 'blocks' in globals())")
    assert stdout(after) == "45 1 False\n"
    # The stream says what happened and names the execution whose effects were lost.
    async with connect(
        f"{gateway.ws_url}/v1/sessions/{sid}/stream?since=0", additional_headers=h
    ) as ws:
        notices = []
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
            if frame["type"] == "event" and frame["event"]["type"] == "notice":
                notices.append(frame["event"]["message"])
            if frame["type"] == "event" and frame["event"]["seq"] >= after["events"][-1]["seq"]:
                break
    recovered = [n for n in notices if "recovered" in n]
    assert recovered and "out of memory" in recovered[0] and bomb["id"] in recovered[0]
    # The export: counts keep going up across the recovery, which is a marked cell of its
    # own between the cell that died and the next one; markdown is rendered, not raw.
    nb = (await http.get(f"/v1/sessions/{sid}/notebook", headers=h)).json()
    kinds = [
        (c["cell_type"], c["metadata"].get("kernelhub", {}).get("execution_id"))
        for c in nb["cells"]
    ]
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in code if c["execution_count"] is not None]
    assert counts == sorted(set(counts)) and len(counts) >= 3, counts
    died = kinds.index(("code", bomb["id"]))
    resumed = kinds.index(("code", after["id"]))
    notes = ["".join(c["source"]) for c in nb["cells"][died + 1 : resumed]]
    assert any("recovered" in n and "out of memory" in n for n in notes), notes
    page = (await http.get(f"/v1/sessions/{sid}/notebook?format=html", headers=h)).text
    assert "<h1>kernelhub session" in page and '<div class="cell md marker">' in page
    assert "<strong>⚠ kernelhub" in page and "**⚠" not in page and "# kernelhub" not in page


async def test_snapshot_and_rewind_over_the_websocket(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    h = auth(token)
    sid = (await http.post("/v1/sessions", json={"checkpoints": "every_cell"}, headers=h)).json()[
        "id"
    ]
    await run(http, token, sid, "x = 1")
    await run(http, token, sid, "x = 2")
    async with connect(f"{gateway.ws_url}/v1/sessions/{sid}/stream", additional_headers=h) as ws:
        await ws.send(json.dumps({"type": "snapshot", "request_id": "s"}))
        await ws.send(json.dumps({"type": "rewind", "before_cell": 2, "request_id": "r"}))
        answers: dict[str, Any] = {}
        while len(answers) < 2:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60 * UNIT))
            if frame["type"] in ("snapshot_created", "rewound", "error"):
                answers[frame["request_id"]] = frame
    assert answers["s"]["type"] == "snapshot_created" and "x" in answers["s"]["snapshot"]["saved"]
    assert (
        answers["r"]["type"] == "rewound" and answers["r"]["report"]["checkpoint_after_cell"] == 1
    )
    assert stdout(await run(http, token, sid, "print(x)")) == "1\n"
