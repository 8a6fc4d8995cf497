"""The benchmark suite: every measurement against its floor, in one run, into one table.

    python bench/suite.py [--quick] [--only exec,cold,...] [--out docs/benchmarks.md]

Machines here are shared and noisy, so each ratio divides two numbers measured in this
run, interleaved sample by sample where the two can take turns. Sections, in order:

- exec: round trip of ``1+1`` through the engine, REST and the WebSocket, and through
  Jupyter Kernel Gateway where installed, against a stock ipykernel driven by plain
  jupyter_client on the host (the floor);
- first-output: ``print`` to its first stream event (engine, WebSocket) vs that floor;
- cold: a new session (engine; gateway without a pool) vs a bare hardened container
  (kernelhub's exact container config running ``python -c pass``, create to exit);
- warm: a new session from a full warm pool (``KERNELHUB_POOL__SIZE=4``) vs the same;
- concurrency: cells/s with 10, 50 and 100 sessions, gateway vs the engine in-process;
- output: 50 MB of output over the WebSocket vs the engine, and the gateway's RSS;
- memory: an idle session's sandbox vs a bare ipykernel on the host;
- hibernate: idle session to hibernated, and the execute that wakes it;
- snapshot: API snapshot and restore vs pickle.dump/pickle.load (and dill) in the same sandbox (``bench/snapshot_api.py``).

``--quick`` runs every section with few samples (a smoke test of a couple of minutes);
its numbers are not for quoting. Everything talks to loopback or unix sockets only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

import docker
import engine
import gateway
import snapshot_api
from floor import FIRST_PRINT, BareContainers, FloorKernel
from gateway import Gateway, WsSession
from jupyter_kernel_gateway import KernelGateway
from memory import container_pss, container_usage, process_memory
from report import (
    REPO,
    MiB,
    Row,
    Unavailable,
    describe_machine,
    markdown,
    median,
    mib,
    ms,
    quantile,
    ratio,
    seconds,
)

from kernelhub.config import Limits, Settings, load_settings
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.backends import make_backend
from kernelhub.sandbox.base import LABEL_INSTANCE, LABEL_MANAGED, LABEL_SESSION, SandboxBackend
from kernelhub.sandbox.state import drop_state_dir

T = TypeVar("T")
SMALL_LIMITS = {"memory_bytes": 128 * MiB}  # 100 sessions must fit on a 24 GiB machine
SMALL_SESSION = {"limits": SMALL_LIMITS}
POOL_SIZE = 4


@dataclass(frozen=True)
class Plan:
    """How many samples each section takes."""

    rounds: int  # exec round trips, interleaved
    warmup: int  # untimed round trips before them
    first_prints: int
    starts: int  # cold starts of each kind
    warm_starts: int
    sessions: tuple[int, ...]  # concurrency levels
    cells: int  # per session at each level
    snapshot_sizes: tuple[int, ...]  # MiB of numeric namespace, snapshotted through the API
    snapshot_runs: int


FULL = Plan(rounds=200, warmup=20, first_prints=15, starts=10, warm_starts=20,
            sessions=(10, 50, 100), cells=50, snapshot_sizes=(10, 100, 500), snapshot_runs=3)  # fmt: skip
# 100 sessions alone take over a minute to start on 2 cores: --quick stops at 50.
QUICK = Plan(rounds=20, warmup=5, first_prints=3, starts=2, warm_starts=3,
             sessions=(10, 50), cells=3, snapshot_sizes=(10,), snapshot_runs=1)  # fmt: skip


async def gather_limited(limit: int, jobs: Iterable[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the jobs, at most ``limit`` at once; results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await job()

    return list(await asyncio.gather(*(one(job) for job in jobs)))


async def interleave(
    runners: dict[str, Callable[[], Awaitable[float]]], rounds: int, warmup: int = 0
) -> dict[str, list[float]]:
    """Each runner once per round, in turn, so that noise hits all of them alike."""
    for _ in range(warmup):
        for run in runners.values():
            await run()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            samples[name].append(await run())
    return samples


class Suite:
    """What the sections share: settings, the engine's backend, the floor kernel, the main
    gateway (no pool), one session on each, and the rows and notes collected so far.
    :meth:`open` acquires them; :meth:`close` releases whatever was acquired."""

    def __init__(self, plan: Plan, settings: Settings, root: Path, run: str) -> None:
        self.plan, self.settings = plan, settings
        self.root = root  # temporary: gateway data, the floor's sockets
        self.run = run  # prefix of every instance label this run creates
        self.rows: list[Row] = []
        self.notes: list[tuple[str, str]] = []
        self.medians: dict[str, float] = {}  # for later sections' floors
        self.engines: list[KernelSession] = []
        self.gateways: list[Gateway] = []
        self._stack = contextlib.AsyncExitStack()

    async def open(self) -> None:
        stack = self._stack
        base_url = self.settings.docker.base_url
        self.docker = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
        stack.push_async_callback(asyncio.to_thread, self._sweep)
        self.backend: SandboxBackend = make_backend(self.settings, instance=f"{self.run}-e")
        stack.push_async_callback(self.backend.close)
        stack.push_async_callback(self.backend.reap_orphans)
        self.bare = BareContainers(
            self.docker, image=self.settings.docker.image, runtime=self.settings.docker.runtime,
            run_dir=self.settings.run_dir, instance=f"{self.run}-b",
        )  # fmt: skip
        self.floor = await FloorKernel.start(self.root)
        stack.push_async_callback(self.floor.stop)
        stack.push_async_callback(self._close_all)
        self.engine_session = await self.start_engine()
        self.gw = await self.launch_gateway("g", {"KERNELHUB_POOL__SIZE": "0"})
        self.http = await stack.enter_async_context(self.gw.client())
        self.sid = await gateway.create_session(self.http)
        stack.push_async_callback(gateway.delete_session, self.http, self.sid)
        self.ws = await stack.enter_async_context(WsSession(self.gw, self.sid))
        # REST gets a session of its own, so no WebSocket client is busy with its events.
        self.rest_sid = await gateway.create_session(self.http)
        stack.push_async_callback(gateway.delete_session, self.http, self.rest_sid)
        self.raw = gateway.RawHttp(self.gw)
        stack.push_async_callback(self.raw.close)

    async def close(self) -> None:
        await self._stack.aclose()

    async def _close_all(self) -> None:
        for session in list(self.engines):
            await self.close_engine(session)
        for gw in list(self.gateways):
            await self.stop_gateway(gw)

    def _remove_containers(self, prefix: str) -> None:
        """Containers whose instance label starts with ``prefix``: found by label, never
        by name."""
        for c in self.docker.containers.list(all=True, filters={"label": f"{LABEL_MANAGED}=true"}):
            if c.labels.get(LABEL_INSTANCE, "").startswith(prefix):
                c.remove(force=True)

    def _sweep(self) -> None:
        """Whatever is left of this run."""
        self._remove_containers(self.run)
        self.docker.close()
        for suffix in ("e", "b", "g", "w", "h"):
            path = self.settings.run_dir / f"{self.run}-{suffix}"
            for state in path.glob("*.state"):  # a tmpfs each, when run as root
                drop_state_dir(state)
            shutil.rmtree(path, ignore_errors=True)

    async def start_engine(self, limits: Limits | None = None) -> KernelSession:
        session = await engine.start(self.backend, limits)
        self.engines.append(session)
        return session

    async def close_engine(self, session: KernelSession) -> None:
        self.engines.remove(session)
        await session.close()

    async def launch_gateway(self, suffix: str, env: dict[str, str]) -> Gateway:
        data = self.root / f"gateway-{suffix}"
        data.mkdir()
        gw = await Gateway.launch(
            data,
            instance=f"{self.run}-{suffix}",  # its own: a gateway reaps its instance at start
            env={
                "KERNELHUB_GATEWAY__MAX_SESSIONS": "128",
                "KERNELHUB_GATEWAY__MAX_SESSIONS_PER_PRINCIPAL": "128",
                **env,
            },
        )
        self.gateways.append(gw)
        return gw

    async def stop_gateway(self, gw: Gateway) -> None:
        """Stop it and remove what it leaves (sessions stay for re-adoption, a pool too),
        so that it costs the later sections nothing."""
        self.gateways.remove(gw)
        await gw.stop()
        await asyncio.to_thread(self._remove_containers, gw.instance)

    def note(self, section: str, text: str) -> None:
        self.notes.append((section, text))

    # -- sections ---------------------------------------------------------------------

    async def exec_roundtrip(self) -> list[Row]:
        section = "exec"
        runners: dict[str, Callable[[], Awaitable[float]]] = {
            "floor": self.floor.roundtrip,
            "engine": lambda: engine.roundtrip(self.engine_session),
            "rest": lambda: gateway.rest_roundtrip(self.http, self.rest_sid),
            "raw": lambda: self.raw.roundtrip(self.rest_sid),
            "ws": lambda: self.ws.run("1+1"),
        }
        kg: KernelGateway | None = None
        kg_missing = ""
        try:
            kg = await KernelGateway.launch(self.root)
            runners["kg"] = kg.roundtrip
        except Unavailable as exc:
            kg_missing = str(exc)
        try:
            s = await interleave(runners, self.plan.rounds, self.plan.warmup)
        finally:
            if kg is not None:
                await kg.stop()
        m = {name: median(samples) for name, samples in s.items()}
        f = m["floor"]
        floor = f"{ms(f)} (jupyter_client)"
        rows = [
            Row(section, "`1+1`, engine in-process (median)", ms(m["engine"]), floor,
                ratio(m["engine"], f), "≤ 1.15×"),
            Row(section, "`1+1`, gateway REST `wait=true`, httpx client (median)", ms(m["rest"]),
                floor, ratio(m["rest"], f)),
            Row(section, "`1+1`, gateway REST `wait=true`, bare HTTP/1.1 client (median)",
                ms(m["raw"]), floor, ratio(m["raw"], f)),
            Row(section, "`1+1`, gateway WebSocket (median)", ms(m["ws"]), floor,
                ratio(m["ws"], f)),
            Row(section, "WebSocket vs the engine: what the gateway adds", ms(m["ws"]),
                f"{ms(m['engine'])} (engine)", ratio(m["ws"], m["engine"]), "≤ 1.15×"),
        ]  # fmt: skip
        if "kg" in m:
            rows += [
                Row(section, "`1+1`, Jupyter Kernel Gateway WebSocket (median)", ms(m["kg"]),
                    floor, ratio(m["kg"], f)),
                Row(section, "kernelhub WebSocket vs Jupyter Kernel Gateway", ms(m["ws"]),
                    f"{ms(m['kg'])} (Kernel Gateway)", ratio(m["ws"], m["kg"])),
            ]  # fmt: skip
        else:
            rows.append(Row(section, "`1+1`, Jupyter Kernel Gateway WebSocket", kg_missing))
        names = {"floor": "floor", "engine": "engine", "rest": "REST (httpx)",
                 "raw": "REST (bare HTTP)", "ws": "WebSocket", "kg": "Kernel Gateway"}  # fmt: skip
        p95 = ", ".join(f"{names[name]} {ms(quantile(v, 0.95))}" for name, v in s.items())
        self.note(
            section,
            f"{self.plan.rounds} round trips of each kind after {self.plan.warmup} untimed ones,"
            f" taken in turn ({', '.join(names[name] for name in s)}) so noise hits all alike."
            " Floor: a stock ipykernel on the host, driven by plain jupyter_client over ipc"
            " (`execute`, then wait for the reply and `idle`). The engine, REST and WebSocket"
            " numbers run in a hardened container."
            + (
                " Jupyter Kernel Gateway runs the floor's stock ipykernel as a host process,"
                " unsandboxed, and relays it over Jupyter Server's WebSocket (legacy JSON"
                " framing); it gets the same `1+1`, timed to the reply and `idle`."
                if "kg" in s
                else ""
            )
            + f" p95: {p95}.",
        )
        return rows

    async def first_output(self) -> list[Row]:
        section = "first output"
        s = await interleave(
            {
                "floor": self.floor.first_print,
                "engine": lambda: engine.first_print(self.engine_session),
                "ws": lambda: self.ws.run(FIRST_PRINT, first_stream=True),
            },
            self.plan.first_prints,
        )
        m = {name: median(samples) for name, samples in s.items()}
        floor = f"{ms(m['floor'])} (stock ipykernel, flush=True)"
        self.note(
            section,
            f"`{FIRST_PRINT}`: time to the first stream event (engine) or frame (WebSocket),"
            f" median of {self.plan.first_prints}. Floor: a stock ipykernel running the same"
            " cell with `print('x', flush=True)` (unflushed, it would wait for its 0.2 s"
            " timer); kernelhub's kernel sends a line written after a quiet 5 ms at once.",
        )
        return [
            Row(section, "`print` → first stream event, engine (median)", ms(m["engine"]), floor,
                ratio(m["engine"], m["floor"]), "≤ 20 ms"),
            Row(section, "`print` → first frame, gateway WebSocket (median)", ms(m["ws"]), floor,
                ratio(m["ws"], m["floor"]), "≤ 20 ms"),
        ]  # fmt: skip

    async def cold_start(self) -> list[Row]:
        section = "cold start"
        s = await interleave(
            {
                "bare": lambda: asyncio.to_thread(self.bare.exit_time),
                "bare kernel": self.bare.kernel_time,
                "engine": lambda: engine.cold_start(self.backend),
                "gateway": lambda: gateway.cold_start(self.http),
            },
            self.plan.starts,
        )
        m = {name: median(samples) for name, samples in s.items()}
        self.medians.update({f"cold {name}": value for name, value in m.items()})
        floor = f"{ms(m['bare'])} (bare container)"
        self.note(
            section,
            f"Median of {self.plan.starts} of each, taken in turn. Floor: `docker run` (docker"
            " SDK) of the kernel image with kernelhub's exact hardening (`container_config`:"
            " no network, read-only root, all capabilities dropped, seccomp, limits) running"
            " `python -c pass`, from create to exit. Engine: `KernelSession.start` to a kernel"
            " that answers. Gateway: `POST /v1/sessions` to 201 with the pool off. The last row"
            " runs stock ipykernel in the same bare container until it answers `kernel_info`."
            f" p90: {', '.join(f'{k} {ms(quantile(v, 0.9))}' for k, v in s.items())}.",
        )
        return [
            Row(section, "engine: create → kernel ready (median)", ms(m["engine"]), floor,
                ratio(m["engine"], m["bare"])),
            Row(section, "gateway, no pool: `POST /v1/sessions` → 201 (median)",
                ms(m["gateway"]), floor, ratio(m["gateway"], m["bare"])),
            Row(section, "engine vs a bare container running stock ipykernel to ready",
                ms(m["engine"]), f"{ms(m['bare kernel'])} (bare container + ipykernel)",
                ratio(m["engine"], m["bare kernel"]), "≤ 1.1×"),
        ]  # fmt: skip

    async def warm_start(self) -> list[Row]:
        section = "warm start"
        gw = await self.launch_gateway("w", {"KERNELHUB_POOL__SIZE": str(POOL_SIZE)})
        samples: list[gateway.WarmStart] = []
        bare: list[float] = []
        try:
            async with gw.client() as http:
                for _ in range(self.plan.warm_starts):
                    # The floor while the pool is full and quiet, then the start itself.
                    await gateway.wait_pool_full(http, POOL_SIZE, timeout=120)
                    bare.append(await asyncio.to_thread(self.bare.exit_time))
                    samples.append(await gateway.warm_start(http, POOL_SIZE, fill_timeout=120))
        except Unavailable as exc:
            self.note(section, f"Not measured: {exc}.")
            return [Row(section, "from a full pool: `POST /v1/sessions` → 201", str(exc))]
        finally:
            await self.stop_gateway(gw)
        warm = [x.seconds for x in samples if x.warm is not False]
        cold = sum(x.warm is False for x in samples)
        unknown = sum(x.warm is None for x in samples)
        b = median(bare)
        floor = f"{ms(b)} (bare container)"
        flags = (
            "the response has no `warm` field, so pool hits cannot be told from cold starts"
            if unknown
            else f"All {len(warm)} counted samples answered `warm: true`"
        )
        self.note(
            section,
            f"A gateway with `KERNELHUB_POOL__SIZE={POOL_SIZE}`; before each of"
            f" {len(samples)} samples the suite waits until `kernelhub_pool_ready` on /metrics"
            f" says {POOL_SIZE}, times one bare container (the floor, median of those), then"
            f" times `POST /v1/sessions` (default limits) to 201. {flags}"
            + (f"; {cold} cold samples (`warm: false`) left out." if cold else "."),
        )
        if not warm:
            return [Row(section, "from a full pool", "every sample was a cold start")]
        return [
            Row(section, "from a full pool: `POST /v1/sessions` → 201 (p50)", ms(median(warm)),
                floor, ratio(median(warm), b), "≤ 30 ms"),
            Row(section, "from a full pool (p90)", ms(quantile(warm, 0.9)), floor,
                ratio(quantile(warm, 0.9), b)),
        ]  # fmt: skip

    async def concurrency(self) -> list[Row]:
        section = "concurrency"
        limits = Limits(**SMALL_LIMITS)
        rounds = max(1, self.plan.cells // 5)
        per_round = max(1, self.plan.cells // rounds)
        cells = rounds * per_round
        rows: list[Row] = []
        startup: list[str] = []
        for n in self.plan.sessions:
            t0 = time.perf_counter()
            sessions = await gather_limited(8, [partial(self.start_engine, limits)] * n)
            engine_up = time.perf_counter() - t0
            rss0 = self.gw.rss()
            t0 = time.perf_counter()
            sids = await gather_limited(
                8, [partial(gateway.create_session, self.http, SMALL_SESSION)] * n
            )
            gateway_up = time.perf_counter() - t0
            rss_per_session = (self.gw.rss() - rss0) / n
            try:
                async with contextlib.AsyncExitStack() as stack:
                    clients = [
                        await stack.enter_async_context(WsSession(self.gw, sid)) for sid in sids
                    ]

                    async def engine_cells(s: KernelSession, k: int) -> None:
                        for _ in range(k):
                            await engine.roundtrip(s)

                    async def ws_cells(ws: WsSession, k: int) -> None:
                        for _ in range(k):
                            await ws.run("1+1")

                    async def timed(jobs: Iterable[Awaitable[None]]) -> float:
                        t0 = time.perf_counter()
                        await asyncio.gather(*jobs)
                        return time.perf_counter() - t0

                    await timed(engine_cells(s, 1) for s in sessions)  # warm-up, untimed
                    await timed(ws_cells(ws, 1) for ws in clients)
                    pairs: list[tuple[float, float]] = []  # (engine, gateway) seconds
                    for r in range(rounds):  # in turns, so that noise hits both alike
                        if r % 2 == 0:
                            e = await timed(engine_cells(s, per_round) for s in sessions)
                            g = await timed(ws_cells(ws, per_round) for ws in clients)
                        else:
                            g = await timed(ws_cells(ws, per_round) for ws in clients)
                            e = await timed(engine_cells(s, per_round) for s in sessions)
                        pairs.append((e, g))
                    floor_rate = n * cells / sum(e for e, _ in pairs)
                    rate = n * cells / sum(g for _, g in pairs)
                    paired = sorted(e / g for e, g in pairs)
            finally:
                await gather_limited(
                    8, [partial(gateway.delete_session, self.http, sid) for sid in sids]
                )
                await asyncio.gather(*(self.close_engine(s) for s in sessions))
            startup.append(f"{n}: engine {seconds(engine_up)}, gateway {seconds(gateway_up)}")
            rows.append(
                Row(section, f"{n} sessions, {cells} cells each: cells/s through the gateway",
                    f"{rate:.0f}", f"{floor_rate:.0f} (engine in-process)",
                    f"{median(paired):.2f}× (rounds {paired[0]:.2f}–{paired[-1]:.2f})",
                    "≥ 0.9×" if n == 50 else "")
            )  # fmt: skip
            if n == max(self.plan.sessions):
                rows.append(
                    Row(section, f"gateway RSS per idle session ({n} sessions)",
                        mib(rss_per_session))
                )  # fmt: skip
        self.note(
            section,
            f"Sessions with a {SMALL_LIMITS['memory_bytes'] // MiB} MiB memory limit, started"
            " 8 at a time (not timed): n in the engine in-process (one `KernelSession` each)"
            " and n in the gateway (one WebSocket client each, connected before the clock"
            " starts), all alive together. Then every session runs `1+1` cells one after the"
            f" other, all sessions of one side at once, {per_round} cells each, the two sides"
            f" taking turns {rounds} times (who goes first alternates) after an untimed cell"
            " each, so that noise hits both alike. The cells/s columns are totals; the ratio"
            " is the median of the rounds' own ratios (engine time over gateway time for the"
            " same cells, measured back to back), with their range: on a shared 2-core"
            " machine a slow patch that hits one side of one round would otherwise decide"
            f" the whole figure. Starting them took {'; '.join(startup)}.",
        )
        return rows

    async def big_output(self) -> list[Row]:
        section = "output"
        session = await self.start_engine(Limits(**gateway.BIG_OUTPUT_LIMITS))
        try:
            floor = await engine.roundtrip(session, gateway.BIG_OUTPUT)
        finally:
            await self.close_engine(session)
        elapsed, growth = await gateway.big_output(self.gw, self.http)
        self.note(
            section,
            "One cell writes 500 lines of 100 kB to stdout. Gateway: over the WebSocket,"
            " to the `final` frame, while the gateway's RSS is sampled every 20 ms. Floor:"
            " the same cell through the engine in-process.",
        )
        return [
            Row(section, "50 MB of output: wall time", seconds(elapsed),
                f"{seconds(floor)} (engine in-process)", ratio(elapsed, floor)),
            Row(section, "50 MB of output: gateway peak RSS growth", mib(growth), "", "",
                "≤ 64 MiB"),
        ]  # fmt: skip

    async def idle_memory(self) -> list[Row]:
        section = "memory"
        bare = await FloorKernel.start(self.root)
        try:
            await bare.roundtrip()
            sid = await gateway.create_session(self.http)
            await gateway.rest_roundtrip(self.http, sid)
            await asyncio.sleep(2)  # idle, and its start-up garbage collected
            rss, pss = process_memory(bare.pid)
            [container] = self.docker.containers.list(
                filters={
                    "label": [f"{LABEL_SESSION}={sid}", f"{LABEL_INSTANCE}={self.gw.instance}"]
                }
            )
            usage, raw = await asyncio.to_thread(container_usage, container)
            sandbox_pss = await asyncio.to_thread(container_pss, container)
            await gateway.delete_session(self.http, sid)
        finally:
            await bare.stop()
        base = pss or rss
        floor = f"{mib(base)} ({'PSS' if pss else 'RSS'} of a bare ipykernel)"
        self.note(
            section,
            "One idle session (default limits, one `1+1` run, then 2 s idle) against a stock"
            " ipykernel on the host in the same state. The cgroup number is the docker stats"
            f" API's usage less inactive file cache, as `docker stats` shows it (raw usage"
            f" {mib(raw)}: it counts page cache and tmpfs too). PSS shares libraries fairly"
            f" between processes; the bare kernel's RSS is {mib(rss)}.",
        )
        return [
            Row(section, "idle session: sandbox cgroup memory (as `docker stats`)", mib(usage),
                floor, ratio(usage, base)),
            Row(section, "idle session: PSS of the sandbox's processes (supervisor + kernel)",
                mib(sandbox_pss) if sandbox_pss is not None else "not readable here",
                floor, ratio(sandbox_pss, base) if sandbox_pss is not None else ""),
        ]  # fmt: skip

    async def hibernation(self) -> list[Row]:
        section = "hibernate"
        gw = await self.launch_gateway(
            "h", {"KERNELHUB_GATEWAY__HIBERNATE_AFTER": "1", "KERNELHUB_POOL__SIZE": "0"}
        )
        try:
            async with gw.client() as http:
                asleep, woke = await gateway.hibernate_wake(http)
        finally:
            await self.stop_gateway(gw)
        cold = self.medians.get("cold gateway")
        self.note(
            section,
            "A gateway of its own with `KERNELHUB_GATEWAY__HIBERNATE_AFTER=1`; the session"
            " holds an 8 MB numpy array. Hibernation is timed from the end of the cell to the"
            " state `hibernated` (the idle second and the idle check included); waking is the"
            " next execute, end to end (a new sandbox, the restore, the cell). One sample each."
            + (" Floor: the gateway's cold start median from this run." if cold else ""),
        )
        return [
            Row(section, "idle 1 s → hibernated (sandbox removed)", seconds(asleep)),
            Row(section, "wake: first execute after hibernation", seconds(woke),
                f"{ms(cold)} (cold start)" if cold else "", ratio(woke, cold) if cold else ""),
        ]  # fmt: skip

    async def snapshots(self) -> list[Row]:
        sizes = self.plan.snapshot_sizes
        rounds = max(self.plan.snapshot_runs, 3)
        results = await snapshot_api.measure(sizes, rounds, self.root / "gateway-snap")
        self.note(
            "snapshot",
            "Through the API, with a gateway of its own and Docker sandboxes (`bench/snapshot_api.py`):"
            f" numeric namespaces of {', '.join(f'{s} MiB' for s in sizes)} (four float64 arrays"
            " and a small dict). Floors: `pickle.dump(protocol=5)` and `pickle.load` of the same"
            " objects in the same sandbox (to its /workspace, a tmpfs), with dill beside them."
            " Restore is `POST /v1/sessions` with `from_snapshot` minus a plain one in the same round."
            f" {rounds} interleaved rounds: median, spread min–max.",
        )
        return snapshot_api.rows(results)


SECTIONS: dict[str, Callable[[Suite], Awaitable[list[Row]]]] = {
    "exec": Suite.exec_roundtrip,
    "first-output": Suite.first_output,
    "cold": Suite.cold_start,
    "warm": Suite.warm_start,
    "concurrency": Suite.concurrency,
    "output": Suite.big_output,
    "memory": Suite.idle_memory,
    "hibernate": Suite.hibernation,
    "snapshot": Suite.snapshots,
}


async def run(plan: Plan, only: list[str], out: Path, quick: bool) -> int:
    settings = load_settings(backend="docker")
    run_id = f"kb{uuid.uuid4().hex[:6]}"
    root = Path(tempfile.mkdtemp(prefix="khb"))  # short: the floor's ipc socket paths
    suite = Suite(plan, settings, root, run_id)
    failed = 0
    started = time.perf_counter()
    try:
        await suite.open()
        machine = describe_machine(
            suite.docker.info(), suite.docker.version(),
            runtime=settings.docker.runtime, image=settings.docker.image,
        )  # fmt: skip
        for name, section in SECTIONS.items():
            if only and name not in only:
                continue
            print(f"[{time.perf_counter() - started:6.1f} s] {name} …", flush=True)
            try:
                rows = await section(suite)
            except Exception as exc:
                traceback.print_exc()
                failed += 1
                rows = [Row(name, "section failed", f"{type(exc).__name__}: {exc}")]
            for row in rows:
                print(f"    {row.measurement}: {row.value}  {row.floor}  {row.ratio}", flush=True)
            suite.rows += rows
    finally:
        await suite.close()
        shutil.rmtree(root, ignore_errors=True)
    took = time.perf_counter() - started
    preamble = [
        f"Generated by `python bench/suite.py{' --quick' if quick else ''}` in {took:.0f} s."
        + (" **A quick run: few samples, a smoke test; not numbers to quote.**" if quick else ""),
        "",
        "Every ratio divides kernelhub's number by a floor measured in the same run, sample"
        " by sample in turn where the two can take turns: the machines are shared and noisy,"
        " ratios are what carries over. Times are medians unless the row says otherwise.",
    ]
    text = markdown(
        title="Benchmarks", preamble=preamble, machine=machine, rows=suite.rows, notes=suite.notes
    )
    print()
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few samples: a smoke test")
    parser.add_argument(
        "--only", default="", help=f"comma-separated sections of: {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--sessions", default="", help="concurrency levels, e.g. 10,50,100 (default: the plan's)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = parser.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    plan = QUICK if args.quick else FULL
    if args.sessions:
        plan = replace(plan, sessions=tuple(int(n) for n in args.sessions.split(",")))
    return asyncio.run(run(plan, only, args.out, args.quick))


if __name__ == "__main__":
    sys.exit(main())
