"""What a client may hold open, and who may come in (issue 16, items 4 and 8), against a
real gateway with real Docker sandboxes: stream limits, non-reading clients cut on every
send path with the gateway's memory bounded, slowloris heads and bodies timed out, a
connection limit with a clear 503, revocation closing open streams, /metrics behind a
token, the handshake refused before 101, the Origin allowlist.

One gateway serves the module, with small limits and short deadlines so every attack
finishes in seconds."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.conftest import RUN_INSTANCE, UNIT, eventually
from tests.gateway.conftest import Gateway, gateway_run_dir, remove_sandboxes

pytestmark = pytest.mark.docker

MiB = 1024 * 1024
PER_SESSION = 20
PER_PRINCIPAL = 24
HEADER_TIMEOUT = 2.0
MAX_CONNECTIONS = 120
METRICS_TOKEN = "kh_metrics-token-for-tests"
ALLOWED = "https://app.example.com"


def env_of_limits() -> dict[str, str]:
    return {
        "KERNELHUB_GATEWAY__MAX_STREAMS_PER_SESSION": str(PER_SESSION),
        "KERNELHUB_GATEWAY__MAX_STREAMS_PER_PRINCIPAL": str(PER_PRINCIPAL),
        "KERNELHUB_GATEWAY__STREAM_STALL_TIMEOUT": "3",
        "KERNELHUB_GATEWAY__STREAM_BUFFER_BYTES": str(MiB),
        "KERNELHUB_GATEWAY__HEADER_TIMEOUT": str(HEADER_TIMEOUT),
        "KERNELHUB_GATEWAY__BODY_TIMEOUT": "2",
        "KERNELHUB_GATEWAY__MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "KERNELHUB_GATEWAY__REVOCATION_CHECK_INTERVAL": "0.5",
        "KERNELHUB_GATEWAY__ALLOWED_ORIGINS": json.dumps([ALLOWED]),
        "KERNELHUB_GATEWAY__METRICS_TOKEN": METRICS_TOKEN,
    }


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = Gateway(
        tmp_path_factory.mktemp("conns") / "data", gateway_run_dir(), **env_of_limits()
    )
    gateway.start()
    # The defaults: every test here but those on `guarded` runs on uvloop and httptools.
    assert "event loop: uvloop; HTTP parser: httptools" in gateway.log.read_text()
    yield gateway
    gateway.stop()
    remove_sandboxes()


@pytest.fixture(scope="module", params=["httptools", "h11"])
def guarded(
    request: pytest.FixtureRequest, gw: Gateway, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """The module's gateway (httptools), then one with the same limits on h11 (and
    asyncio's loop): the guards hold on either parser."""
    if request.param == "httptools":
        yield gw
        return
    instance = f"{RUN_INSTANCE}-h11"
    gateway = Gateway(
        tmp_path_factory.mktemp("conns-h11") / "data",
        gateway_run_dir(),
        **env_of_limits(),
        KERNELHUB_GATEWAY__HTTP_PARSER="h11",
        KERNELHUB_GATEWAY__EVENT_LOOP="asyncio",
        KERNELHUB_GATEWAY__INSTANCE=instance,
    )
    gateway.start()
    assert "event loop: asyncio; HTTP parser: h11" in gateway.log.read_text()
    yield gateway
    gateway.stop()
    remove_sandboxes(instance)


@pytest.fixture(scope="module")
def alice(gw: Gateway) -> str:
    return gw.token("alice")


@pytest.fixture(scope="module")
def sid(gw: Gateway, alice: str) -> str:
    """Alice's session; its cells may emit up to 64 MiB."""
    r = httpx.post(
        f"{gw.url}/v1/sessions",
        json={"limits": {"output_bytes": 64 * MiB}},
        headers=auth(alice),
        timeout=120 * UNIT,
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def stream_url(gw: Gateway, sid: str, since: int = 0) -> str:
    return f"{gw.ws_url}/v1/sessions/{sid}/stream?since={since}"


async def open_stream(gw: Gateway, sid: str, token: str, **headers: str) -> ClientConnection:
    """A stream past its hello."""
    ws = await connect(stream_url(gw, sid), additional_headers={**auth(token), **headers})
    hello = json.loads(await ws.recv())
    assert hello["type"] == "hello", hello
    return ws


async def refusal(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body a handshake was refused with (never a 101)."""
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url, additional_headers=headers):
            pass
    response = refused.value.response
    return response.status_code, json.loads(bytes(response.body))


def raw_socket(gw: Gateway, *, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10 * UNIT)
    s.connect(("127.0.0.1", gw.port))
    return s


def non_reading_stream(gw: Gateway, sid: str, token: str, since: int) -> socket.socket:
    """A WebSocket client that completes the handshake, then never reads again."""
    s = raw_socket(gw, rcvbuf=4096)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(
        f"GET /v1/sessions/{sid}/stream?since={since} HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\n"
        f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)  # byte by byte: nothing after the head is read
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def connections_to(gw: Gateway, clients: list[socket.socket]) -> int:
    """How many of ``clients`` the gateway still holds a connection to."""
    ports = {c.getsockname()[1] for c in clients}
    conns = psutil.Process(gw.proc.pid if gw.proc else 0).net_connections(kind="tcp")
    return sum(1 for k in conns if k.raddr and k.raddr.port in ports)


def read_until_closed(s: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes (EOF or reset), within ``timeout``."""
    s.settimeout(timeout)
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            got += chunk
    return got


async def test_handshake_without_a_valid_token_is_refused_before_101(
    gw: Gateway, alice: str, sid: str
) -> None:
    status, body = await refusal(stream_url(gw, sid), {})
    assert status == 401 and body["error"] == "unauthorized", body
    assert "Authorization: Bearer" in body["message"]
    status, body = await refusal(stream_url(gw, sid), auth("kh_not-a-token"))
    assert status == 401 and "unknown or revoked token" in body["message"], body
    async with connect(f"{stream_url(gw, sid)}&token={alice}") as ws:
        assert json.loads(await ws.recv())["type"] == "hello"


async def test_origin_allowlist(gw: Gateway, alice: str, sid: str) -> None:
    status, body = await refusal(stream_url(gw, sid), {**auth(alice), "Origin": "http://evil.test"})
    assert status == 403 and body["error"] == "forbidden", body
    assert "KERNELHUB_GATEWAY__ALLOWED_ORIGINS" in body["message"]
    for origin in (None, ALLOWED, f"http://127.0.0.1:{gw.port}"):  # none, allowed, its own
        ws = await open_stream(gw, sid, alice, **({"Origin": origin} if origin else {}))
        await ws.close()
    async with httpx.AsyncClient(base_url=gw.url, headers=auth(alice)) as http:
        evil = await http.get("/v1/sessions", headers={"Origin": "http://evil.test"})
        assert evil.status_code == 403, evil.text
        own = await http.get("/v1/sessions", headers={"Origin": gw.url})
        assert own.status_code == 200, own.text


async def test_stream_limits_per_session_and_per_principal(
    gw: Gateway, alice: str, sid: str
) -> None:
    async with httpx.AsyncClient(base_url=gw.url, headers=auth(alice), timeout=120 * UNIT) as http:
        r = await http.post("/v1/sessions", json={})
        assert r.status_code == 201, r.text
        other = r.json()["id"]
    streams = [await open_stream(gw, sid, alice) for _ in range(PER_SESSION)]
    try:
        status, body = await refusal(stream_url(gw, sid), auth(alice))
        assert status == 429 and "MAX_STREAMS_PER_SESSION" in body["message"], body
        streams += [await open_stream(gw, other, alice) for _ in range(PER_PRINCIPAL - PER_SESSION)]
        status, body = await refusal(stream_url(gw, other), auth(alice))
        assert status == 429 and "MAX_STREAMS_PER_PRINCIPAL" in body["message"], body
        # A stream that closes gives its place back.
        await streams.pop(0).close()
        deadline = time.monotonic() + 5 * UNIT
        while True:
            try:
                streams.append(await open_stream(gw, sid, alice))
                break
            except InvalidStatus:
                assert time.monotonic() < deadline, "a closed stream kept its place"
                await asyncio.sleep(0.05)
    finally:
        for ws in streams:
            await ws.close()
        async with httpx.AsyncClient(base_url=gw.url, headers=auth(alice)) as http:
            await http.delete(f"/v1/sessions/{other}")


async def test_revocation_closes_the_tokens_open_streams_within_seconds(gw: Gateway) -> None:
    carol = gw.token("carol")
    async with httpx.AsyncClient(base_url=gw.url, headers=auth(carol), timeout=120 * UNIT) as http:
        r = await http.post("/v1/sessions", json={})
        assert r.status_code == 201, r.text
        session = r.json()["id"]
        ws = await open_stream(gw, session, carol)
        await asyncio.to_thread(gw.cli, "token", "revoke", "carol")
        revoked_at = time.monotonic()
        assert (await http.get("/v1/sessions")).status_code == 401  # REST: at once
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(5 * UNIT):
                while True:
                    await ws.recv()
        took = time.monotonic() - revoked_at
        await ws.close()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401, closed.value
    assert "revoked" in closed.value.rcvd.reason
    assert took < 5 * UNIT


async def test_metrics_needs_a_token_and_only_admins_see_session_ids(
    gw: Gateway, alice: str, sid: str
) -> None:
    admin = await asyncio.to_thread(gw.token, "root", admin=True)
    async with httpx.AsyncClient(base_url=gw.url) as http:
        anonymous = await http.get("/metrics")
        assert anonymous.status_code == 401, anonymous.text
        assert sid not in anonymous.text
        for token in (alice, METRICS_TOKEN):
            r = await http.get("/metrics", headers=auth(token))
            assert r.status_code == 200 and "kernelhub_sessions" in r.text, r.text
            assert sid not in r.text and 'session="' not in r.text
        r = await http.get("/metrics", headers=auth(admin))
        assert r.status_code == 200 and f'session="{sid}"' in r.text, r.text


class PeakRss:
    """The gateway's highest RSS while in the ``with`` block, sampled every 10 ms."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.gw.rss())
            await asyncio.sleep(0.01)

    async def __aenter__(self) -> PeakRss:
        self.peak = self.gw.rss()
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.peak = max(self.peak, self.gw.rss())


async def test_non_reading_clients_are_cut_and_gateway_memory_stays_bounded(
    gw: Gateway, alice: str, sid: str
) -> None:
    # One 30 MB display: every client's copy used to wait in its socket buffer forever,
    # because on the direct-write path nothing waited on it with a deadline.
    cell = "display({'text/plain': 'x' * 30_000_000}, raw=True)"
    async with httpx.AsyncClient(base_url=gw.url, headers=auth(alice), timeout=120 * UNIT) as http:

        async def run() -> None:
            r = await http.post(f"/v1/sessions/{sid}/executions", json={"code": cell, "wait": True})
            assert r.status_code == 200 and r.json()["status"] == "completed", r.text

        async with PeakRss(gw) as alone:  # what the cell itself costs, without clients
            await run()
        since = (await http.get(f"/v1/sessions/{sid}")).json()["last_seq"]
        baseline = gw.rss()
        clients = [non_reading_stream(gw, sid, alice, since) for _ in range(PER_SESSION)]
        try:
            t0 = time.monotonic()
            async with PeakRss(gw) as watched:
                await run()
                # Cut, and the memory back: 20 copies held would be ~600 MiB.
                await eventually(lambda: gw.rss() < baseline + 64 * MiB, 20)
            settled_after = time.monotonic() - t0
            # The gateway itself drops them (stall cut-off): read only after, or reading
            # would count as the client catching up.
            await eventually(lambda: connections_to(gw, clients) == 0, 60)
            cut = await asyncio.gather(
                *(asyncio.to_thread(read_until_closed, c, 10 * UNIT) for c in clients)
            )
            assert all(len(got) < 30_000_000 for got in cut)  # none took the whole frame
            print(
                f"baseline {baseline / MiB:.0f} MiB; peak alone {alone.peak / MiB:.0f} MiB, "
                f"with 20 non-reading clients {watched.peak / MiB:.0f} MiB; "
                f"settled after {settled_after:.1f} s"
            )
            # One shared copy of the frame, not one per client.
            assert watched.peak < alone.peak + 100 * MiB
        finally:
            for c in clients:
                c.close()
        # The session still serves a reading client.
        ws = await open_stream(gw, sid, alice)
        await ws.close()


async def test_non_reading_clients_behind_a_flood_read_no_pages_from_the_store(
    gw: Gateway, alice: str
) -> None:
    # A client further behind than its buffer catches up from the store, a page (up to
    # 500 events) at a time. One that reads nothing used to get its page anyway, its own
    # copy, held while the page's first frame waited on it: 20 such clients of one 30 MB
    # print held ~20 x 30 MB. Now the next page waits until the client took the last.
    cell = "import sys\nfor i in range(300):\n    sys.stdout.write('y' * 100_000 + '\\n')"
    async with httpx.AsyncClient(base_url=gw.url, headers=auth(alice), timeout=120 * UNIT) as http:
        r = await http.post("/v1/sessions", json={"limits": {"output_bytes": 64 * MiB}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]

        async def run() -> None:
            r = await http.post(f"/v1/sessions/{sid}/executions", json={"code": cell, "wait": True})
            assert r.status_code == 200 and r.json()["status"] == "completed", r.text

        async with PeakRss(gw) as alone:
            await run()
        since = (await http.get(f"/v1/sessions/{sid}")).json()["last_seq"]
        clients = [non_reading_stream(gw, sid, alice, since) for _ in range(PER_SESSION)]
        try:
            async with PeakRss(gw) as watched:
                await run()
                # Until the gateway cut them all (the stall cut-off): pages would be read
                # meanwhile.
                await eventually(lambda: connections_to(gw, clients) == 0, 60)
        finally:
            for c in clients:
                c.close()
        grown = (watched.peak - alone.peak) / MiB
        assert grown < 100, f"{PER_SESSION} non-reading clients cost {grown:.0f} MiB more"
        await http.delete(f"/v1/sessions/{sid}")


def test_slowloris_heads_and_bodies_are_timed_out(guarded: Gateway) -> None:
    gw = guarded
    alice = gw.token("slowloris")  # a token of its own, on either gateway
    half_heads = []
    for _ in range(60):
        s = raw_socket(gw)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never finished
        half_heads.append(s)
    slow_body = raw_socket(gw)
    slow_body.sendall(
        b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + alice.encode() + b"\r\nContent-Length: 100\r\n\r\n{"
    )
    t0 = time.monotonic()
    assert httpx.get(f"{gw.url}/healthz").status_code == 200  # others are still served
    answers = [read_until_closed(s, 4 * HEADER_TIMEOUT * UNIT) for s in half_heads]
    took = time.monotonic() - t0
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"KERNELHUB_GATEWAY__HEADER_TIMEOUT" in answer
    assert took < 3 * HEADER_TIMEOUT * UNIT
    body_answer = read_until_closed(slow_body, 10 * UNIT)
    assert body_answer.startswith(b"HTTP/1.1 408") and b"BODY_TIMEOUT" in body_answer
    for s in [*half_heads, slow_body]:
        s.close()
    assert httpx.get(f"{gw.url}/healthz").status_code == 200


def test_connections_past_the_limit_are_refused_with_503(guarded: Gateway) -> None:
    gw = guarded
    sockets = [raw_socket(gw) for _ in range(MAX_CONNECTIONS + 10)]
    try:
        # The refused ones are answered at once; the held ones only at the header timeout.
        deadline = time.monotonic() + HEADER_TIMEOUT * UNIT / 2
        answered: list[socket.socket] = []
        while len(answered) < 10 and time.monotonic() < deadline:
            answered, _, _ = select.select(sockets, [], [], 0.05)
        assert 10 <= len(answered) < len(sockets), len(answered)
        for s in answered:
            answer = read_until_closed(s, 5 * UNIT)
            assert answer.startswith(b"HTTP/1.1 503"), answer
            assert b"KERNELHUB_GATEWAY__MAX_CONNECTIONS" in answer and b"retry-after" in answer
    finally:
        for s in sockets:
            s.close()

    def served() -> bool:
        try:
            return httpx.get(f"{gw.url}/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    asyncio.run(eventually(served, 5))
