"""Gateway benchmark, in one run against the engine floor on the same machine.

    python bench/gateway.py [--rounds 100] [--out docs/bench-gateway.md]

- exec round trip of ``1+1``: over the WebSocket and over REST (``wait=true``) vs the
  engine called directly in-process (the floor the gateway adds to);
- throughput with 10 and 50 concurrent sessions: gateway (one WebSocket client each) vs
  the engine driving the same number of sessions in-process;
- first byte of a ``print`` over the WebSocket;
- a 50 MB output: wall time and the gateway's peak RSS growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil
from websockets.asyncio.client import connect

from kernelhub.config import load_settings
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.backends import make_backend
from kernelhub.sandbox.base import SandboxSpec

INSTANCE = f"bg{uuid.uuid4().hex[:6]}"
MiB = 2**20


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


class Gateway:
    def __init__(self, data: Path, **extra_env: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws = f"ws://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "KERNELHUB_DATA_DIR": str(data),
            "KERNELHUB_BACKEND": "docker",
            "KERNELHUB_GATEWAY__PORT": str(self.port),
            "KERNELHUB_GATEWAY__INSTANCE": INSTANCE,
            "KERNELHUB_GATEWAY__MAX_SESSIONS": "128",
            "KERNELHUB_GATEWAY__MAX_SESSIONS_PER_PRINCIPAL": "128",
            **extra_env,
        }
        self.token = subprocess.run(
            [sys.executable, "-m", "kernelhub.cli", "token", "create", "--name", "bench"],
            env=self.env, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kernelhub.cli", "serve"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(600):
            try:
                if httpx.get(f"{self.url}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        self.headers = {"Authorization": f"Bearer {self.token}"}

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class WsSession:
    """One WebSocket client running cells one at a time."""

    def __init__(self, gw: Gateway, sid: str) -> None:
        self.gw, self.sid = gw, sid

    async def __aenter__(self) -> WsSession:
        self.conn = await connect(
            f"{self.gw.ws}/v1/sessions/{self.sid}/stream",
            additional_headers=self.gw.headers,
            max_size=2**26,
        )
        hello = json.loads(await self.conn.recv())
        self.last = hello["last_seq"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.conn.close()

    async def run(self, code: str, first_stream: bool = False) -> float:
        t0 = time.perf_counter()
        request = uuid.uuid4().hex
        await self.conn.send(json.dumps({"type": "execute", "code": code, "request_id": request}))
        first = None
        mine = None
        while True:
            frame = json.loads(await self.conn.recv())
            if frame["type"] == "accepted" and frame["request_id"] == request:
                mine = frame["execution_id"]
            if frame["type"] != "event" or frame["event"]["execution_id"] != mine:
                continue  # other executions of the session (the REST rounds) stream here too
            event = frame["event"]
            if event["type"] == "stream" and first is None:
                first = time.perf_counter() - t0
            if event["type"] == "final":
                return first if first_stream and first is not None else time.perf_counter() - t0


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument(
        "--cells", type=int, default=20, help="cells per session in the concurrency runs"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/bench-gateway.md"))
    args = parser.parse_args()
    settings = load_settings(backend="docker")
    backend = make_backend(settings, instance=INSTANCE + "e")
    gw = Gateway(Path(tempfile.mkdtemp(prefix="khbg")))
    rows: list[tuple[str, str, str, str, str]] = []
    http = httpx.AsyncClient(base_url=gw.url, headers=gw.headers, timeout=300)
    engines: list[KernelSession] = []
    try:
        engine = await KernelSession.start(backend, SandboxSpec(session_id=uuid.uuid4().hex[:12]))
        engines.append(engine)
        sid = (await http.post("/v1/sessions", json={})).json()["id"]
        async with WsSession(gw, sid) as ws:
            for _ in range(20):
                await engine.execute("1+1")
                await ws.run("1+1")
            floor, over_ws, over_rest = [], [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                await engine.execute("1+1")
                floor.append(time.perf_counter() - t0)
                over_ws.append(await ws.run("1+1"))
                t0 = time.perf_counter()
                r = await http.post(
                    f"/v1/sessions/{sid}/executions", json={"code": "1+1", "wait": True}
                )
                assert r.status_code == 200
                over_rest.append(time.perf_counter() - t0)
            f = statistics.median(floor)
            w, r_ = statistics.median(over_ws), statistics.median(over_rest)
            rows.append(
                ("exec `1+1` over WebSocket (median)", ms(w), ms(f), f"{w / f:.2f}×", "≤ 1.15×")
            )
            rows.append(
                ("exec `1+1` over REST wait=true (median)", ms(r_), ms(f), f"{r_ / f:.2f}×", "")
            )
            firsts = [
                await ws.run("print('x'); import time; time.sleep(0.2)", first_stream=True)
                for _ in range(10)
            ]
            rows.append(
                (
                    "`print` → first stream frame over WebSocket (median)",
                    ms(statistics.median(firsts)),
                    "",
                    "",
                    "≤ 20 ms",
                )
            )

            # 50 MB of output through the gateway, measuring its RSS.
            await http.delete(f"/v1/sessions/{sid}")
        sid = (
            await http.post(
                "/v1/sessions",
                json={"limits": {"output_bytes": 64 * MiB, "memory_bytes": 2048 * MiB}},
            )
        ).json()["id"]
        peak = base_rss = gw.rss()
        stop = asyncio.Event()

        async def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, gw.rss())
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        async with WsSession(gw, sid) as ws:
            t = await ws.run(
                "import sys\nfor i in range(500):\n    sys.stdout.write('z' * 100_000 + '\\n')"
            )
        stop.set()
        await sampler
        rows.append(
            (
                "50 MB output over WebSocket: time / gateway RSS growth",
                f"{t:.2f} s",
                "",
                f"{(peak - base_rss) / MiB:.0f} MiB",
                "≤ 64 MiB",
            )
        )
        await http.delete(f"/v1/sessions/{sid}")

        # Hibernation: an idle session is snapshotted and its sandbox removed; the next
        # execute wakes it. Measured on a gateway of its own with a 1 s idle threshold.
        hgw = Gateway(
            Path(tempfile.mkdtemp(prefix="khbh")),
            KERNELHUB_GATEWAY__HIBERNATE_AFTER="1",
            KERNELHUB_GATEWAY__INSTANCE=INSTANCE + "h",  # its own: a start reaps its instance
        )
        try:
            async with httpx.AsyncClient(base_url=hgw.url, headers=hgw.headers, timeout=300) as h:
                hsid = (await h.post("/v1/sessions", json={})).json()["id"]
                await h.post(
                    f"/v1/sessions/{hsid}/executions",
                    json={"code": "import numpy as np\nx = np.arange(10**6)", "wait": True},
                )
                t0 = time.perf_counter()
                while (await h.get(f"/v1/sessions/{hsid}")).json()["state"] != "hibernated":
                    await asyncio.sleep(0.02)
                asleep = time.perf_counter() - t0
                t0 = time.perf_counter()
                r = await h.post(
                    f"/v1/sessions/{hsid}/executions", json={"code": "int(x.sum())", "wait": True}
                )
                woke = time.perf_counter() - t0
                assert r.json()["status"] == "completed", r.text
                await h.delete(f"/v1/sessions/{hsid}")
            rows.append(
                (
                    "hibernate (idle 1 s → sandbox gone, incl. the idle check)",
                    f"{asleep:.2f} s",
                    "",
                    "",
                    "",
                )
            )
            rows.append(
                ("wake: first execute after hibernation, end to end", f"{woke:.2f} s", "", "", "")
            )
        finally:
            hgw.stop()

        for n in (10, 50):
            sessions = [
                await KernelSession.start(backend, SandboxSpec(session_id=uuid.uuid4().hex[:12]))
                for _ in range(n)
            ]
            engines += sessions
            t0 = time.perf_counter()

            async def engine_worker(s: KernelSession) -> None:
                for _ in range(args.cells):
                    await s.execute("1+1")

            await asyncio.gather(*(engine_worker(s) for s in sessions))
            floor_tput = n * args.cells / (time.perf_counter() - t0)
            for s in sessions:
                await s.close()
            small = {"limits": {"memory_bytes": 256 * MiB}}
            sids = [(await http.post("/v1/sessions", json=small)).json()["id"] for _ in range(n)]

            async def gw_worker(sid: str) -> None:
                async with WsSession(gw, sid) as ws:
                    for _ in range(args.cells):
                        await ws.run("1+1")

            t0 = time.perf_counter()
            await asyncio.gather(*(gw_worker(s) for s in sids))
            gw_tput = n * args.cells / (time.perf_counter() - t0)
            for s in sids:
                await http.delete(f"/v1/sessions/{s}")
            rows.append(
                (
                    f"{n} concurrent sessions: cells/s",
                    f"{gw_tput:.0f}",
                    f"{floor_tput:.0f}",
                    f"{gw_tput / floor_tput:.2f}×",
                    "≥ 0.9× (50)",
                )
            )
    finally:
        for e in engines:
            await e.close()
        await http.aclose()
        gw.stop()
        await backend.reap_orphans()
        await backend.close()
        import docker

        client = docker.from_env()
        for c in client.containers.list(all=True, filters={"label": "org.kernelhub.managed=true"}):
            if c.labels.get("org.kernelhub.instance", "").startswith(INSTANCE):
                c.remove(force=True)
        client.close()

    machine = f"{platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}"
    lines = [
        "# Gateway benchmark",
        "",
        f"Machine: {machine}; docker backend; floor = the engine in-process; interleaved runs.",
        f"Generated by `python bench/gateway.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| measurement | gateway | floor | ratio | target |",
        "|---|---|---|---|---|",
        *[f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
