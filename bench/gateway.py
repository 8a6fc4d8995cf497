"""The gateway as its clients see it: ``kernelhub serve`` in a child process on a loopback
port, driven over REST and the WebSocket stream (``docs/protocol.md``)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from report import MiB, Unavailable
from websockets.asyncio.client import ClientConnection, connect

BIG_OUTPUT = "import sys\nfor i in range(500):\n    sys.stdout.write('z' * 100_000 + '\\n')"
BIG_OUTPUT_LIMITS = {"output_bytes": 64 * MiB, "memory_bytes": 2048 * MiB}
POOL_GAUGE = "kernelhub_pool_ready"
CELL_TIMEOUT = 300.0  # seconds: WsSession.run's bound on one cell's frames


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    """``kernelhub serve`` with a data directory, an instance label and a token of its own.
    ``env`` adds ``KERNELHUB_*`` settings. Start with :meth:`launch`; :meth:`stop` ends it."""

    def __init__(self, data: Path, *, instance: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.instance = instance
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.log = data / "gateway.log"
        self.env = {
            **os.environ,
            "KERNELHUB_DATA_DIR": str(data),
            "KERNELHUB_BACKEND": "docker",
            "KERNELHUB_GATEWAY__HOST": "127.0.0.1",
            "KERNELHUB_GATEWAY__PORT": str(self.port),
            "KERNELHUB_GATEWAY__INSTANCE": instance,
            **env,
        }
        self.headers: dict[str, str] = {}
        self.proc: asyncio.subprocess.Process | None = None

    @classmethod
    async def launch(
        cls, data: Path, *, instance: str, env: dict[str, str], timeout: float = 120
    ) -> Gateway:
        gw = cls(data, instance=instance, env=env)
        try:
            await gw._start(timeout)
        except BaseException:
            await gw.stop()
            raise
        return gw

    async def _start(self, timeout: float) -> None:
        token = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kernelhub.cli", "token", "create", "--name", "bench",
            env=self.env, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await token.communicate()
        if token.returncode != 0:
            raise RuntimeError(f"`kernelhub token create` failed with {token.returncode}")
        self.headers = {"Authorization": f"Bearer {out.decode().strip()}"}
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kernelhub.cli", "serve",
                env=self.env, stdout=log, stderr=log, cwd=self.log.parent,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url) as http:
            while True:
                if self.proc.returncode is not None:
                    raise RuntimeError(
                        f"gateway exited with {self.proc.returncode}; see {self.log}"
                    )
                try:
                    if (await http.get("/readyz")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway not ready after {timeout} s; see {self.log}")
                await asyncio.sleep(0.05)

    def client(self) -> httpx.AsyncClient:
        # uvicorn closes an idle keep-alive connection after 5 s, httpx's default expiry:
        # a request sent on one at that moment failed with ReadError (the suite's output
        # section, at load 10). Expiring ours first leaves no such moment.
        return httpx.AsyncClient(
            base_url=self.url, headers=self.headers, timeout=300,
            limits=httpx.Limits(keepalive_expiry=2.0),
        )  # fmt: skip

    def rss(self) -> int:
        assert self.proc is not None
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def create_session(http: httpx.AsyncClient, body: dict[str, Any] | None = None) -> str:
    return str((await create_timed(http, body))[1]["id"])


async def create_timed(
    http: httpx.AsyncClient, body: dict[str, Any] | None = None
) -> tuple[float, dict[str, Any]]:
    """Seconds for ``POST /v1/sessions`` to answer 201, and the session it returned."""
    t0 = time.perf_counter()
    r = await http.post("/v1/sessions", json=body or {})
    elapsed = time.perf_counter() - t0
    if r.status_code != 201:
        raise RuntimeError(f"POST /v1/sessions: {r.status_code} {r.text}")
    info: dict[str, Any] = r.json()
    return elapsed, info


async def delete_session(http: httpx.AsyncClient, sid: str) -> None:
    r = await http.delete(f"/v1/sessions/{sid}")
    if r.status_code >= 300 and r.status_code != 404:
        raise RuntimeError(f"DELETE /v1/sessions/{sid}: {r.status_code} {r.text}")


async def cold_start(http: httpx.AsyncClient) -> float:
    """Seconds for a new session (default limits) to be created; deleting it is not timed."""
    elapsed, info = await create_timed(http)
    await delete_session(http, info["id"])
    return elapsed


async def rest_roundtrip(http: httpx.AsyncClient, sid: str, code: str = "1+1") -> float:
    t0 = time.perf_counter()
    r = await http.post(f"/v1/sessions/{sid}/executions", json={"code": code, "wait": True})
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200 and r.json()["status"] == "completed", r.text
    return elapsed


class RawHttp:
    """A bare HTTP/1.1 keep-alive client on one connection: how much of a REST round trip
    is the gateway's, without a Python HTTP client's own cost (httpx adds ~1.5 ms)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: dict[str, object]) -> tuple[float, bytes]:
        if self.streams is None:
            self.streams = await asyncio.open_connection("127.0.0.1", self.gw.port)
        reader, writer = self.streams
        data = json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in self.gw.headers.items())
        request = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode() + data
        t0 = time.perf_counter()
        writer.write(request)
        response = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in response.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        payload = await reader.readexactly(length)
        return time.perf_counter() - t0, payload

    async def roundtrip(self, sid: str, code: str = "1+1") -> float:
        elapsed, payload = await self.post(
            f"/v1/sessions/{sid}/executions", {"code": code, "wait": True}
        )
        assert json.loads(payload)["status"] == "completed", payload[:300]
        return elapsed

    async def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


class WsSession:
    """One WebSocket client of one session, running cells one at a time."""

    def __init__(self, gw: Gateway, sid: str) -> None:
        self.gw, self.sid = gw, sid
        self.conn: ClientConnection | None = None

    async def __aenter__(self) -> WsSession:
        self.conn = await connect(
            f"{self.gw.ws_url}/v1/sessions/{self.sid}/stream",
            additional_headers=self.gw.headers,
            max_size=2**26,
        )
        json.loads(await self.conn.recv())  # hello
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.conn is not None:
            await self.conn.close()

    async def run(
        self, code: str = "1+1", *, first_stream: bool = False, timeout: float = CELL_TIMEOUT
    ) -> float:
        """Seconds from sending ``execute`` to its ``final`` event, or with ``first_stream``
        to its first ``stream`` event. A cell whose frames do not come in ``timeout``
        seconds raises (the suite once waited for ever on one at 100 sessions)."""
        try:
            async with asyncio.timeout(timeout):
                return await self._run(code, first_stream)
        except TimeoutError:
            raise RuntimeError(
                f"session {self.sid}: no `final` frame for {code[:40]!r} in {timeout:g} s"
            ) from None

    async def _run(self, code: str, first_stream: bool) -> float:
        assert self.conn is not None
        t0 = time.perf_counter()
        request = uuid.uuid4().hex
        await self.conn.send(json.dumps({"type": "execute", "code": code, "request_id": request}))
        first = None
        mine = None
        early: dict[str, list[dict[str, Any]]] = {}  # events may precede their `accepted`
        while True:
            frame = json.loads(await self.conn.recv())
            if frame["type"] == "error" and frame.get("request_id") == request:
                # Refused (a quota, a limit): waiting for its `final` would wait for ever.
                raise RuntimeError(f"session {self.sid}: {frame['error']}: {frame['message']}")
            if frame["type"] == "accepted" and frame["request_id"] == request:
                mine = frame["execution_id"]
                events = early.pop(mine, [])
            elif frame["type"] == "event":
                event = frame["event"]
                if mine is None:
                    early.setdefault(event["execution_id"], []).append(event)
                    continue
                events = [event] if event["execution_id"] == mine else []
            else:
                continue  # other executions of the session stream here too
            for event in events:
                if event["type"] == "stream" and first is None:
                    first = time.perf_counter() - t0
                if event["type"] == "final":
                    assert event["record"]["status"] == "completed", event["record"]
                    return first if first_stream and first is not None else time.perf_counter() - t0


async def big_output(gw: Gateway, http: httpx.AsyncClient) -> tuple[float, int]:
    """A 50 MB output over the WebSocket: (seconds, the gateway's peak RSS growth)."""
    sid = await create_session(http, {"limits": BIG_OUTPUT_LIMITS})
    peak = base = gw.rss()
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, gw.rss())
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    try:
        async with WsSession(gw, sid) as ws:
            elapsed = await ws.run(BIG_OUTPUT)
    finally:
        stop.set()
        await sampler
        await delete_session(http, sid)
    return elapsed, peak - base


async def hibernate_wake(http: httpx.AsyncClient) -> tuple[float, float]:
    """On a gateway with ``hibernate_after`` = 1 s: seconds until an idle session is
    hibernated (including the idle second), and seconds for the execute that wakes it."""
    sid = await create_session(http)
    try:
        await rest_roundtrip(http, sid, "import numpy as np\nx = np.arange(10**6)")
        t0 = time.perf_counter()
        while (await http.get(f"/v1/sessions/{sid}")).json()["state"] != "hibernated":
            if time.perf_counter() - t0 > 60:
                raise RuntimeError("the session did not hibernate within 60 s")
            await asyncio.sleep(0.02)
        asleep = time.perf_counter() - t0
        woke = await rest_roundtrip(http, sid, "int(x.sum())")
    finally:
        await delete_session(http, sid)
    return asleep, woke


async def pool_ready(http: httpx.AsyncClient) -> float | None:
    """The ``kernelhub_pool_ready`` gauge, or None when /metrics has no such gauge."""
    r = await http.get("/metrics")
    r.raise_for_status()
    for family in text_string_to_metric_families(r.text):
        if family.name == POOL_GAUGE:
            return sum(sample.value for sample in family.samples)
    return None


async def wait_pool_full(http: httpx.AsyncClient, size: int, timeout: float) -> None:
    """Return once the pool holds ``size`` ready sandboxes; :class:`Unavailable` if the
    gateway has no pool gauge, RuntimeError if it does not fill within ``timeout``."""
    t0 = time.monotonic()
    ready: float | None = None
    while True:
        ready = await pool_ready(http)
        if ready is not None and ready >= size:
            return
        waited = time.monotonic() - t0
        if ready is None and waited > 5:
            raise Unavailable(f"pool not available: no `{POOL_GAUGE}` gauge on /metrics")
        if waited > timeout:
            raise RuntimeError(
                f"the pool did not fill: {ready or 0:.0f}/{size} ready after {timeout} s"
            )
        await asyncio.sleep(0.05)


@dataclass(frozen=True)
class WarmStart:
    seconds: float
    warm: bool | None  # the response's ``warm`` field; None when it has none


async def warm_start(http: httpx.AsyncClient, size: int, fill_timeout: float) -> WarmStart:
    """Wait for a full pool, then time ``POST /v1/sessions`` (default limits, so the pool
    serves it); the session is deleted afterwards."""
    await wait_pool_full(http, size, fill_timeout)
    elapsed, info = await create_timed(http)
    await delete_session(http, info["id"])
    warm = info.get("warm")
    return WarmStart(elapsed, warm if isinstance(warm, bool) else None)
