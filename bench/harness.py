"""What the suite's sections share: the plan, and the :class:`Suite` that holds the
Docker client, the engine's backend, the floor kernel, the main gateway and its sessions,
the peers, and the rows, notes and chart series collected so far.

Sections are functions of a :class:`Suite` (``latency.py``, ``starts.py``, ``load.py``,
``idle.py``, ``snapshot_section.py``, ``durable.py``); ``suite.py`` runs them and writes the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import docker
import engine
import gateway
from floor import BareContainers, FloorKernel
from gateway import Gateway, WsSession
from peers import PEERS, Peer, PeerKernel
from report import MiB, Row, Unavailable

from kernelhub.config import GatewaySettings, Limits, Settings
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.backends import make_backend
from kernelhub.sandbox.base import LABEL_INSTANCE, LABEL_MANAGED, SandboxBackend
from kernelhub.sandbox.state import drop_state_dir

T = TypeVar("T")
SMALL_LIMITS = {"memory_bytes": 128 * MiB}  # 100 sessions must fit on a 24 GiB machine
SMALL_SESSION = {"limits": SMALL_LIMITS}
POOL_SIZE = 4
# One WebSocket client per session at 100 sessions, all of one principal (the bench's
# token), where the gateway caps a principal's streams.
STREAMS = (
    {"KERNELHUB_GATEWAY__MAX_STREAMS_PER_PRINCIPAL": "256"}
    if "max_streams_per_principal" in GatewaySettings.model_fields
    else {}
)


@dataclass(frozen=True)
class Plan:
    """How many samples each section takes. Every comparison runs ``rounds`` interleaved
    rounds (the first contender rotating) after untimed warm-up."""

    rounds: int  # ≥ 3: a spread of fewer says nothing
    warmup: int  # untimed turns of each contender before the rounds
    exec_per_round: int  # `1+1` round trips of each contender per round
    first_prints: int  # per round
    starts: int  # cold starts of each kind per round
    sessions: tuple[int, ...]  # concurrency levels
    peer_sessions: int  # the peer runs the levels up to this many kernels
    cells: int  # per session per round at each level
    snapshot_rows: int
    snapshot_sizes: tuple[int, ...]  # MiB of numeric namespace (bench/snapshot_api.py)
    snapshot_runs: int
    checkpoint_cells: int  # per session and think time, in blocks of 10 (bench/checkpoints.py)
    wake_runs: int  # hibernate-and-wake cycles (bench/wake.py)


FULL = Plan(rounds=5, warmup=20, exec_per_round=40, first_prints=5, starts=3,
            sessions=(10, 50, 100), peer_sessions=50, cells=10, snapshot_rows=3_000_000,
            snapshot_sizes=(10, 100, 500), snapshot_runs=3, checkpoint_cells=60,
            wake_runs=3)  # fmt: skip
# 100 sessions alone take over a minute to start on 2 cores: --quick stops at 10.
QUICK = Plan(rounds=3, warmup=3, exec_per_round=5, first_prints=2, starts=1,
             sessions=(4, 10), peer_sessions=10, cells=3, snapshot_rows=100_000,
             snapshot_sizes=(10,), snapshot_runs=1, checkpoint_cells=30,
             wake_runs=1)  # fmt: skip


async def gather_limited(limit: int, jobs: Iterable[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the jobs, at most ``limit`` at once; results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await job()

    return list(await asyncio.gather(*(one(job) for job in jobs)))


class Suite:
    """The shared resources. :meth:`open` acquires them; :meth:`close` releases whatever
    was acquired."""

    def __init__(self, plan: Plan, settings: Settings, root: Path, run: str) -> None:
        self.plan, self.settings = plan, settings
        self.root = root  # temporary: gateway data, the floor's sockets
        self.run = run  # prefix of every instance label this run creates
        self.rows: list[Row] = []
        self.notes: list[tuple[str, str]] = []
        self.medians: dict[str, float] = {}  # for later sections' floors
        self.series: dict[str, Any] = {}  # for the charts (charts.py)
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
        # sparse: a full listing inspects every managed container on the machine, and one
        # another run removed meanwhile raised NotFound and ended this run's teardown.
        listed = self.docker.containers.list(
            all=True, sparse=True, filters={"label": f"{LABEL_MANAGED}=true"}
        )
        for c in listed:
            if (c.attrs.get("Labels") or {}).get(LABEL_INSTANCE, "").startswith(prefix):
                with contextlib.suppress(docker.errors.NotFound):
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
                # 100 sessions of one principal: their cells' output caps are reserved
                # against its storage quota (1 GiB by default), so the default quota
                # refuses cells at 100 at once; an operator running that many raises it.
                "KERNELHUB_STORAGE__QUOTA_BYTES": str(64 * 1024 * MiB),
                **STREAMS,
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

    @contextlib.asynccontextmanager
    async def peers(self, section: str, keys: Iterable[str]) -> AsyncIterator[dict[str, Peer]]:
        """The peers named by ``keys`` (:data:`peers.PEERS`) that could start; a note for
        each that could not."""
        started: dict[str, Peer] = {}

        async def launch(key: str) -> None:
            try:
                started[key] = await Peer.launch(PEERS[key], self.root)
            except (Unavailable, RuntimeError) as exc:
                self.note(section, f"{PEERS[key].label} not measured: {exc}.")

        try:
            await asyncio.gather(*(launch(key) for key in keys))  # start-up is not timed
            yield {key: started[key] for key in PEERS if key in started}
        finally:
            for peer in started.values():
                await peer.stop()

    @contextlib.asynccontextmanager
    async def peer_kernels(
        self, section: str, keys: Iterable[str]
    ) -> AsyncIterator[dict[str, PeerKernel]]:
        """One kernel on each peer of :meth:`peers`."""
        async with self.peers(section, keys) as started:
            kernels = await asyncio.gather(*(peer.kernel() for peer in started.values()))
            yield dict(zip(started, kernels, strict=True))

    def note(self, section: str, text: str) -> None:
        self.notes.append((section, text))
