"""One tenant's output must not stall another's: a neighbour's ``1+1`` latency and the
gateway's memory while an attacker's cell floods it.

Run alone (not part of ``bench/suite.py``, not a timed test; a few minutes, real Docker)::

    python bench/neighbours.py [--out docs/tenant-safety.md]

A real ``kernelhub serve`` (Docker backend, default limits) runs two principals. The
neighbour runs ``1+1`` over REST every 100 ms the whole time; for each attack in turn the
attacker's session runs the cell, and we record the neighbour's latencies during it (p50,
p99, max) and the gateway's RSS growth over its RSS when the attack started (sampled every
50 ms). Targets (issue #16): p99 <= 250 ms, growth <= 64 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from gateway import Gateway, create_session
from loop_cpu import ENV as LOOP_CPU_ENV
from loop_cpu import SITECUSTOMIZE
from loop_cpu import read as read_loop_cpu
from report import MiB, describe_machine, quantile, table

TARGET_P99 = 0.250
TARGET_RSS = 64 * MiB
ATTACK_TIMEOUT = 300.0

STDOUT_FLOOD = "import sys\nfor i in range(1000):\n    sys.stdout.write('y' * 100_000 + '\\n')"
ATTACKS: list[tuple[str, str]] = [
    ("idle (baseline)", "import time; time.sleep(5)"),
    ("100 MB stdout flood", STDOUT_FLOOD),
    ("200 MiB os.write flood", "import os\nb = b'w' * (1 << 20)\nfor i in range(200):\n    os.write(1, b)"),
    ("64 MiB single line", "print('L' * (64 << 20))"),
    (
        "5 x 20 MB display metadata",
        "from IPython.display import display\nfor i in range(5):\n"
        "    display({'text/plain': str(i)}, raw=True, metadata={'m': 'm' * 20_000_000})",
    ),
    ("20 MB exception", "raise Exception('x' * 20_000_000)"),
    (
        "3 x 7 MB displays, one streaming reader",
        "from IPython.display import display\nfor i in range(3):\n"
        "    display({'text/html': 'h' * 7_000_000, 'text/plain': str(i)}, raw=True)",
    ),
    ("100k clear_output", "from IPython.display import clear_output\nfor i in range(100_000):\n    clear_output()"),
    ("30 stalled readers, 100 MB printed", STDOUT_FLOOD),
]  # fmt: skip
STALLED_READERS = 30
HEADER = [
    "attack", "outcome", "samples", "p50", "p99", "max", "/healthz max",
    "loop lag > 5 ms", "longest loop lag", "longest callback: CPU / wall",
    "CPU s: gateway / attacker / neighbour kernel", "attacker throttled",
    "run-queue wait s: gateway / neighbour kernel",
    "gateway RSS growth", "on target",
]  # fmt: skip
# Slicing off in the gateway (--unsliced): every message through json in one call, as
# before kernelhub.jsonslices, to compare the loop lag of the same code with and without.
UNSLICED = "import kernelhub.jsonslices as j\nj.SLICE = 1 << 40\n"
BEGIN = "<!-- bench/neighbours.py: begin -->"
END = "<!-- bench/neighbours.py: end -->"


@dataclass
class Outcome:
    name: str
    latencies: list[float] = field(default_factory=list)
    rss_growth: int = 0
    status: str = ""
    output_bytes: int = 0
    dropped_bytes: int = 0
    dropped_events: int = 0
    seconds: float = 0.0
    healthz_max: float = 0.0
    lag_over_5ms: int = 0  # loop lag samples over 5 ms during the attack
    lag_bound: float = 0.0  # the longest loop lag was at most this (a histogram bucket)
    callback_cpu: float = 0.0  # the longest CPU time of one gateway loop callback
    callback_wall: float = 0.0  # the longest wall time of one
    callback_what: str = ""  # which callback took callback_cpu
    gateway_cpu: float = 0.0  # seconds of CPU during the attack (all threads)
    attacker_cpu: float = 0.0  # of the attacker's container
    neighbour_cpu: float = 0.0  # of the neighbour's container
    throttled: float = 0.0  # seconds the attacker's container was throttled by its quota
    gateway_wait: float = 0.0  # seconds the gateway's threads waited for a CPU
    neighbour_wait: float = 0.0  # seconds the neighbour kernel's threads waited for one


class Neighbour:
    """``1+1`` every 100 ms on its own session; latencies land in ``into``."""

    def __init__(self, http: httpx.AsyncClient, sid: str) -> None:
        self.http, self.sid = http, sid
        self.into: list[float] = []
        self.failures = 0
        self.box: str | None = None  # its container's id

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            try:
                r = await self.http.post(
                    f"/v1/sessions/{self.sid}/executions", json={"code": "1+1", "wait": True}
                )
                ok = r.status_code == 200 and r.json()["status"] == "completed"
            except httpx.HTTPError:
                ok = False
            elapsed = time.perf_counter() - t0
            if ok:
                self.into.append(elapsed)
            else:
                self.failures += 1
            await asyncio.sleep(max(0.1 - elapsed, 0.0))


async def sample_rss(gw: Gateway, base: int, out: Outcome) -> None:
    while True:
        out.rss_growth = max(out.rss_growth, gw.rss() - base)
        await asyncio.sleep(0.05)


async def probe_healthz(http: httpx.AsyncClient, out: Outcome) -> None:
    while True:
        t0 = time.perf_counter()
        with contextlib.suppress(httpx.HTTPError):
            await http.get("/healthz")
        out.healthz_max = max(out.healthz_max, time.perf_counter() - t0)
        await asyncio.sleep(0.1)


def stalled_reader(port: int, path: str, token: str) -> socket.socket:
    """A WebSocket client that completes the handshake and then never reads."""
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
        chunk = sock.recv(1)
        if not chunk:
            break
        head += chunk
    return sock


async def loop_lag(http: httpx.AsyncClient) -> dict[str, float]:
    """The gateway's loop-lag histogram (kernelhub_loop_lag_seconds): count per bucket."""
    text = (await http.get("/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kernelhub_loop_lag_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[le] = float(line.split()[-1])
        elif line.startswith("kernelhub_loop_lag_seconds_count"):
            out["count"] = float(line.split()[-1])
    return out


def reading_reader(gw: Gateway, sid: str, token: str) -> socket.socket:
    """A WebSocket client that reads everything (in a thread of its own), so every event
    is also framed for a live subscriber."""
    import threading

    from websockets.sync.client import connect

    ws = connect(
        f"{gw.ws_url}/v1/sessions/{sid}/stream",
        additional_headers={"Authorization": f"Bearer {token}"}, max_size=None,
    )  # fmt: skip

    def drain() -> None:
        with contextlib.suppress(Exception):
            while True:
                ws.recv()

    threading.Thread(target=drain, daemon=True).start()
    return ws.socket


def _container_id(instance: str, sid: str) -> str | None:
    import docker

    client = docker.from_env()
    try:
        labels = [f"org.kernelhub.instance={instance}", f"org.kernelhub.session={sid}"]
        found = client.containers.list(filters={"label": labels})
        return found[0].id if found else None
    finally:
        client.close()


def container_cpu(container: str | None) -> tuple[float, float]:
    """(CPU seconds used, seconds throttled by its quota) of a container, from its cgroup
    (v1 cgroupfs or v2 systemd layouts); zeros when it cannot be read."""
    if container is None:
        return 0.0, 0.0
    root = Path("/sys/fs/cgroup")
    v1_usage = root / "cpuacct" / "docker" / container / "cpuacct.usage"
    if v1_usage.exists():
        stat = dict(
            line.split()
            for line in (root / "cpu" / "docker" / container / "cpu.stat").read_text().splitlines()
        )
        return int(v1_usage.read_text()) / 1e9, int(stat.get("throttled_time", 0)) / 1e9
    for v2 in (root / "system.slice" / f"docker-{container}.scope", root / "docker" / container):
        if (v2 / "cpu.stat").exists():
            stat = dict(line.split() for line in (v2 / "cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6, int(stat.get("throttled_usec", 0)) / 1e6
    return 0.0, 0.0


def run_queue_wait(tids: list[int]) -> float:
    """Seconds these threads spent runnable but waiting for a CPU (/proc/*/schedstat): how
    much of a latency was the scheduler's, whoever had the core."""
    total = 0
    for tid in tids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{tid}/schedstat").read_text().split()[1])
    return total / 1e9


def container_tids(container: str | None) -> list[int]:
    if container is None:
        return []
    for tasks in (
        Path("/sys/fs/cgroup/cpu/docker") / container / "tasks",
        Path("/sys/fs/cgroup/system.slice") / f"docker-{container}.scope" / "cgroup.threads",
    ):
        if tasks.exists():
            return [int(t) for t in tasks.read_text().split()]
    return []


def process_tids(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def process_cpu(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def new_token(gw: Gateway, name: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kernelhub.cli", "token", "create", "--name", name,
        env=gw.env, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    return out.decode().strip()


async def attack(
    gw: Gateway,
    attacker: httpx.AsyncClient,
    token: str,
    neighbour: Neighbour,
    name: str,
    code: str,
    loop_cpu_dir: Path,
) -> Outcome:
    out = Outcome(name)
    sid = await create_session(attacker)
    attacker_box = await asyncio.to_thread(_container_id, gw.instance, sid)
    assert gw.proc is not None
    readers: list[socket.socket] = []
    if "stalled" in name:
        path = f"/v1/sessions/{sid}/stream"
        for _ in range(STALLED_READERS):
            readers.append(await asyncio.to_thread(stalled_reader, gw.port, path, token))
    if "streaming reader" in name:
        readers.append(await asyncio.to_thread(reading_reader, gw, sid, token))
    neighbour.into = out.latencies
    lag_before = await loop_lag(attacker)
    cpu_before = (
        process_cpu(gw.proc.pid),
        container_cpu(attacker_box),
        container_cpu(neighbour.box),
    )
    gateway_tids, neighbour_tids = process_tids(gw.proc.pid), container_tids(neighbour.box)
    wait_before = run_queue_wait(gateway_tids), run_queue_wait(neighbour_tids)
    wall_start = time.time()
    tasks = [
        asyncio.create_task(sample_rss(gw, gw.rss(), out)),
        asyncio.create_task(probe_healthz(attacker, out)),
    ]
    t0 = time.perf_counter()
    try:
        r = await attacker.post(f"/v1/sessions/{sid}/executions", json={"code": code})
        eid = r.json()["id"]
        deadline = time.monotonic() + ATTACK_TIMEOUT
        while time.monotonic() < deadline:
            info = (await attacker.get(f"/v1/executions/{eid}?events=false")).json()
            if info.get("record"):
                record = info["record"]
                out.status = record["status"]
                out.output_bytes = record.get("output_bytes", 0)
                out.dropped_bytes = record.get("dropped_bytes", 0)
                out.dropped_events = record.get("dropped_events", 0)
                break
            await asyncio.sleep(0.1)
        else:
            out.status = "did not finish"
        out.seconds = time.perf_counter() - t0
        await asyncio.sleep(1.0)  # what the gateway still holds just after
        lag_after = await loop_lag(attacker)
        diff = {le: lag_after[le] - lag_before.get(le, 0) for le in lag_after}
        total = diff.pop("count", 0)
        out.lag_over_5ms = int(total - diff.get("0.005", 0))
        out.lag_bound = min((float(le) for le, n in diff.items() if n >= total), default=0.0)
        out.gateway_cpu = process_cpu(gw.proc.pid) - cpu_before[0]
        used, throttled = container_cpu(attacker_box)
        out.attacker_cpu, out.throttled = used - cpu_before[1][0], throttled - cpu_before[1][1]
        out.neighbour_cpu = container_cpu(neighbour.box)[0] - cpu_before[2][0]
        out.gateway_wait = run_queue_wait(gateway_tids) - wait_before[0]
        out.neighbour_wait = run_queue_wait(neighbour_tids) - wait_before[1]
        callbacks = read_loop_cpu(loop_cpu_dir, gw.proc.pid, wall_start, time.time())
        if callbacks:
            longest = max(callbacks, key=lambda c: c.cpu)
            out.callback_cpu, out.callback_what = longest.cpu, longest.what
            out.callback_wall = max(c.wall for c in callbacks)
    finally:
        for task in tasks:
            task.cancel()
        for sock in readers:
            sock.close()
        neighbour.into = []
        with contextlib.suppress(httpx.HTTPError):
            await attacker.delete(f"/v1/sessions/{sid}")
    return out


def render(outcomes: list[Outcome], machine: list[tuple[str, str]], failures: int) -> str:
    def ms(x: float) -> str:
        return f"{x * 1000:.0f} ms"

    rows = []
    for o in outcomes:
        lat = o.latencies or [float("nan")]
        p99 = quantile(lat, 0.99)
        ok = p99 <= TARGET_P99 and o.rss_growth <= TARGET_RSS
        rows.append(
            [
                o.name,
                f"{o.status} in {o.seconds:.1f} s; kept {o.output_bytes / MiB:.1f} MiB, dropped "
                f"{o.dropped_bytes / MiB:.1f} MiB / {o.dropped_events} msgs",
                str(len(o.latencies)),
                ms(quantile(lat, 0.5)),
                ms(p99),
                ms(max(lat)),
                ms(o.healthz_max),
                str(o.lag_over_5ms),
                f"≤ {ms(o.lag_bound)}" if o.lag_bound else "n/a",
                f"{o.callback_cpu * 1000:.1f} / {o.callback_wall * 1000:.0f} ms",
                f"{o.gateway_cpu:.1f} / {o.attacker_cpu:.1f} / {o.neighbour_cpu:.2f}",
                f"{o.throttled:.1f} s",
                f"{o.gateway_wait:.1f} / {o.neighbour_wait:.2f}",
                f"{o.rss_growth / MiB:.0f} MiB",
                "yes" if ok else "no",
            ]
        )
    longest = [
        [o.name, f"{o.callback_cpu * 1000:.1f} ms", o.callback_what or "-"] for o in outcomes
    ]
    lines = [
        BEGIN,
        "Measured by `python bench/neighbours.py` (issue #16, item 2): a real gateway "
        "(Docker backend, default limits: 10 MiB output per cell), a neighbour principal "
        "running `1+1` over REST every 100 ms, an attacker principal running each cell "
        "below in a fresh session. Latencies are the neighbour's during the attack; RSS "
        "growth is the gateway's peak over its RSS when the attack started. Targets: p99 "
        f"<= {ms(TARGET_P99)}, RSS growth <= {TARGET_RSS // MiB} MiB. Neighbour requests "
        f'that failed: {failures}. "Longest callback" is the most CPU time one callback of '
        "the gateway's event loop took during the attack (`time.thread_time()` around each "
        "callback, bench/loop_cpu.py), beside the longest wall time of one: the first is "
        "ours, the gap between them the scheduler's. CPU seconds are the gateway process's "
        "and each sandbox's (its cgroup) during the attack; throttled: how long the "
        "attacker's CPU quota held it back; run-queue wait: how long the threads of the "
        "gateway and of the neighbour's kernel were ready to run but had no core "
        "(/proc/*/schedstat).",
        "",
        *table(["", ""], [[k, v] for k, v in machine]),
        "",
        *table(HEADER, rows),
        "",
        "The longest callback of each attack:",
        "",
        *table(["attack", "CPU", "callback"], longest),
        END,
    ]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Put ``section`` between the markers in ``path`` (the rest of the page is prose that
    reads the numbers), or make ``path`` of it if it has no markers."""
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = "# Tenant safety: one tenant's output against a neighbour\n\n" + section + "\n"
    path.write_text(text)


async def main(out_path: Path | None, only: str | None = None, unsliced: bool = False) -> str:
    import docker

    started = time.monotonic()
    client = docker.from_env()
    image = os.environ.get("KERNELHUB_DOCKER__IMAGE", "")
    machine = describe_machine(
        client.info(), client.version(), runtime="runc", image=image or "default"
    )
    client.close()
    with tempfile.TemporaryDirectory(prefix="kh-neighbours-") as tmp:
        instance = f"nb-{uuid.uuid4().hex[:8]}"
        env = {"KERNELHUB_POOL__SIZE": "0", "KERNELHUB_RUN_DIR": f"/tmp/khnb-{instance}"}
        # The gateway times each of its loop's callbacks (bench/loop_cpu.py).
        shim = Path(tmp) / "shim"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(SITECUSTOMIZE + (UNSLICED if unsliced else ""))
        loop_cpu_dir = Path(tmp) / "loopcpu"
        loop_cpu_dir.mkdir()
        env[LOOP_CPU_ENV] = str(loop_cpu_dir)
        # loop_cpu wraps asyncio.Handle._run, which uvloop's callbacks never pass through.
        env["KERNELHUB_GATEWAY__EVENT_LOOP"] = "asyncio"
        here = str(Path(__file__).resolve().parent)
        env["PYTHONPATH"] = os.pathsep.join([str(shim), here, os.environ.get("PYTHONPATH", "")])
        gw = await Gateway.launch(Path(tmp), instance=instance, env=env)
        assert gw.proc is not None
        print(f"gateway pid {gw.proc.pid}, log {gw.log}", file=sys.stderr, flush=True)
        try:
            attacker_token = gw.headers["Authorization"].split()[1]
            neighbour_token = await new_token(gw, "neighbour")
            async with (
                gw.client() as attacker,
                httpx.AsyncClient(
                    base_url=gw.url,
                    headers={"Authorization": f"Bearer {neighbour_token}"},
                    timeout=60,
                ) as nhttp,
            ):
                nsid = await create_session(nhttp)
                neighbour = Neighbour(nhttp, nsid)
                neighbour.box = await asyncio.to_thread(_container_id, instance, nsid)
                for _ in range(5):  # warm up
                    await nhttp.post(
                        f"/v1/sessions/{nsid}/executions", json={"code": "1+1", "wait": True}
                    )
                runner = asyncio.create_task(neighbour.run())
                outcomes = []
                try:
                    for name, code in ATTACKS:
                        if only is not None and only not in name:
                            continue
                        outcome = await attack(
                            gw, attacker, attacker_token, neighbour, name, code, loop_cpu_dir
                        )
                        print(
                            f"{name}: p99 {quantile(outcome.latencies or [0], 0.99) * 1000:.0f} ms,"
                            f" rss +{outcome.rss_growth / MiB:.0f} MiB, {outcome.status}",
                            flush=True,
                        )
                        outcomes.append(outcome)
                finally:
                    runner.cancel()
        finally:
            await gw.stop()
            _remove_sandboxes(instance)
    text = render(outcomes, machine, neighbour.failures)
    print(f"bench/neighbours.py ran in {time.monotonic() - started:.0f} s", file=sys.stderr)
    if out_path is not None:
        write_section(out_path, text)
    return text


def _remove_sandboxes(instance: str) -> None:
    import docker

    client = docker.from_env()
    label = f"org.kernelhub.instance={instance}"
    for container in client.containers.list(all=True, filters={"label": label}):
        container.remove(force=True)
    client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown here")
    parser.add_argument("--only", default=None, help="run the attacks whose name has this")
    parser.add_argument(
        "--unsliced", action="store_true",
        help="the gateway with kernelhub.jsonslices off (json in one call): the before",
    )  # fmt: skip
    args = parser.parse_args()
    print(asyncio.run(main(args.out, args.only, args.unsliced)))
