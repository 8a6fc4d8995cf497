"""The warm pools: sandboxes with running kernels, started before anyone asks for them.

A session created with a pool's limits (and runtime) takes one (a dict pop, no Docker
call) instead of waiting for a container and a kernel to come up. Each pooled sandbox is
handed out once and never returned: a sandbox that ran somebody's code is never seen by
anybody else. There is one pool for the default limits (``KERNELHUB_POOL__SIZE``) and one
for each profile the operator names in ``KERNELHUB_POOL__PROFILES``, with that profile's
limits and isolation.

Pooled sandboxes carry the session id they will have (the id is in their labels, socket
directory and state directory) and the owner label :data:`POOL_OWNER`; the real owner is
recorded in the store when a session takes one. They are not re-adopted after a gateway
restart (nobody owns them): start-up reaps them with the other orphans and the pools refill.

Refills give way to sessions: while a session's own sandbox is starting (a create that
found its pool empty), no refill begins, so a burst's cold starts do not queue behind the
pool's on two cores (measured: a burst of 8 on a pool of 4 waited 1.5-2.8 s when both ran
at once).

Contract: the manager calls ``start()`` once after reaping orphans, ``take()`` on every
create, wraps each cold start of a session in ``session_start()``, calls ``drain()`` for
the emergency stop and ``close()`` at shutdown. ``room(memory_bytes)`` (given by the
manager) says whether the host's budgets allow one more sandbox of that size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kernelhub import profiles
from kernelhub.config import EngineSettings, Limits, Settings
from kernelhub.errors import ConfigError, KernelhubError
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.base import SandboxBackend, SandboxSpec
from kernelhub.wire import LimitsIn

log = logging.getLogger(__name__)

POOL_OWNER = "kernelhub-pool"
_RETRY_INTERVAL = 2.0  # after a failed start; doubles up to _RETRY_MAX
_RETRY_MAX = 60.0
_SETTLE = 0.25  # quiet time after a take before a refill begins


@dataclass(frozen=True)
class PoolKind:
    """What a pool's sandboxes are: the limits and OCI runtime a session must have to
    take one. ``name`` is the profile's, or "" for the default limits' pool."""

    name: str
    size: int
    limits: Limits
    runtime: str | None = None


def pool_kinds(settings: Settings, backend: str, runtimes: frozenset[str]) -> list[PoolKind]:
    """The pools the settings ask for: the default limits' (``KERNELHUB_POOL__SIZE``), then
    one per profile in ``KERNELHUB_POOL__PROFILES`` with the limits and runtime a session
    of that profile gets when it asks for nothing. ConfigError for a profile that does not
    exist or whose isolation this gateway cannot give."""
    kinds = [PoolKind("", settings.pool.size, settings.limits)]
    for name, size in settings.pool.profiles.items():
        if not 0 <= size <= 64:
            raise ConfigError(
                f"KERNELHUB_POOL__PROFILES asks for {size} sandboxes for {name!r}; "
                'give 0 to 64, e.g. {"untrusted": 2}'
            )
        if name not in settings.profiles.tiers:
            raise ConfigError(
                f"KERNELHUB_POOL__PROFILES names the profile {name!r}, which "
                f"KERNELHUB_PROFILES__TIERS does not define (it has: "
                f"{sorted(settings.profiles.tiers) or 'none'})"
            )
        chosen = profiles.Chosen(name, settings.profiles.tiers[name])
        try:
            runtime = profiles.runtime_for(chosen, backend, runtimes)
        except KernelhubError as exc:
            raise ConfigError(f"KERNELHUB_POOL__PROFILES: {exc}") from exc
        limits = profiles.resolve_limits(settings, LimitsIn(), chosen.profile.limits)
        kinds.append(PoolKind(name, size, limits, runtime))
    return kinds


class Demand:
    """Sessions whose own sandbox is starting, and when a pool last handed one out:
    refills wait until neither happened for ``settle`` seconds (a burst is answered
    before the pool's Docker calls compete with it for the cores)."""

    def __init__(self, settle: float = _SETTLE) -> None:
        self.count = 0
        self.settle = settle
        self.last = -math.inf  # monotonic time of the last take or session start
        self._quiet = asyncio.Event()
        self._quiet.set()

    def touch(self) -> None:
        self.last = time.monotonic()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        self.count += 1
        self._quiet.clear()
        self.touch()
        try:
            yield
        finally:
            self.count -= 1
            self.touch()
            if self.count == 0:
                self._quiet.set()

    async def quiet(self) -> None:
        while True:
            await self._quiet.wait()
            wait = self.last + self.settle - time.monotonic()
            if wait <= 0 and self._quiet.is_set():
                return
            await asyncio.sleep(max(wait, 0.0))


class WarmPool:
    """One pool: ``kind.size`` ready sandboxes of one kind."""

    def __init__(
        self,
        backend: SandboxBackend,
        kind: PoolKind,
        engine: EngineSettings,
        room: Callable[[int], bool],
        *,
        refill_concurrency: int = 1,
        demand: Demand | None = None,
    ) -> None:
        self.backend = backend
        self.kind = kind
        self.engine = engine
        self.room = room
        self.refill_concurrency = refill_concurrency
        self.demand = demand or Demand()
        self._ready: deque[KernelSession] = deque()
        self._starting = 0
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.hits = 0
        self.misses = 0

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def held(self) -> int:
        """Sandboxes the pool has, ready or starting."""
        return len(self._ready) + self._starting

    @property
    def committed_bytes(self) -> int:
        """Memory the pooled (and starting) sandboxes may use, for the host budget."""
        return self.held * self.kind.limits.memory_bytes

    def matches(self, limits: Limits, runtime: str | None) -> bool:
        return limits == self.kind.limits and runtime == self.kind.runtime

    def start(self) -> None:
        if self.kind.size > 0 and self._task is None:
            name = f"kernelhub-warm-pool-{self.kind.name or 'default'}"
            self._task = asyncio.create_task(self._refill(), name=name)
            self._wanted.set()

    def take(self) -> KernelSession | None:
        """A ready kernel, or None (the caller starts one cold). Never blocks."""
        self.demand.touch()
        while self._ready:
            kernel = self._ready.popleft()
            self._wanted.set()
            if kernel.alive:
                self.hits += 1
                return kernel
            self.discard(kernel)
        if self.kind.size > 0:
            self.misses += 1
        return None

    def poke(self) -> None:
        """Budgets changed (a session ended): refill if there is room now."""
        self._wanted.set()

    async def evict(self) -> bool:
        """Stop one pooled sandbox to free its memory for a session; False if none."""
        if not self._ready:
            return False
        await self._ready.pop().close()
        return True

    async def drain(self) -> int:
        """Stop every pooled sandbox now (the emergency stop). Refilling goes on."""
        kernels = list(self._ready)
        self._ready.clear()
        for kernel in kernels:
            await kernel.close()
        self._wanted.set()
        return len(kernels)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        # Nobody re-adopts a pooled sandbox, so it goes now rather than at the next reap.
        await self.drain()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def discard(self, kernel: KernelSession) -> None:
        """Stop a sandbox taken from the pool that will not be used after all."""
        task = asyncio.create_task(kernel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _short(self) -> int:
        return self.kind.size - len(self._ready) - self._starting

    def _may_start(self) -> bool:
        return self._short() > 0 and self.room(self.kind.limits.memory_bytes)

    async def _refill(self) -> None:
        backoff = _RETRY_INTERVAL
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            while True:
                await self.demand.quiet()
                if not self._may_start():
                    break
                batch = min(self._short(), self.refill_concurrency)
                self._starting += batch
                try:
                    results = await asyncio.gather(
                        *(self._start_one() for _ in range(batch)), return_exceptions=True
                    )
                finally:
                    self._starting -= batch
                failures = []
                for r in results:
                    if isinstance(r, BaseException):
                        failures.append(r)
                    else:
                        self._ready.append(r)
                if failures:
                    for f in failures:
                        if not isinstance(f, KernelhubError):
                            raise f
                    log.warning(
                        "warm pool %r: a sandbox failed to start (%s); retrying in %.0f s",
                        self.kind.name or "default", failures[0], backoff,
                    )  # fmt: skip
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _RETRY_MAX)
                else:
                    backoff = _RETRY_INTERVAL

    async def _start_one(self) -> KernelSession:
        t0 = time.monotonic()
        spec = SandboxSpec(
            session_id=uuid.uuid4().hex[:16],
            owner=POOL_OWNER,
            limits=self.kind.limits,
            runtime=self.kind.runtime,
        )
        kernel = await KernelSession.start(self.backend, spec, engine=self.engine)
        log.debug("warm pool: sandbox %s ready in %.2f s", spec.session_id, time.monotonic() - t0)
        return kernel


class WarmPools:
    """Every pool of the gateway, as one: the manager's single collaborator for them.
    Pools are added with :meth:`add` before :meth:`start`."""

    def __init__(
        self,
        backend: SandboxBackend,
        engine: EngineSettings,
        room: Callable[[int], bool],
        *,
        refill_concurrency: int = 1,
        settle: float = _SETTLE,
    ) -> None:
        self.backend = backend
        self.engine = engine
        self.room = room
        self.refill_concurrency = refill_concurrency
        self.demand = Demand(settle)
        self.pools: list[WarmPool] = []

    def add(self, kind: PoolKind) -> WarmPool:
        pool = WarmPool(
            self.backend, kind, self.engine, self.room,
            refill_concurrency=self.refill_concurrency, demand=self.demand,
        )  # fmt: skip
        self.pools.append(pool)
        return pool

    @property
    def enabled(self) -> bool:
        return any(p.kind.size > 0 for p in self.pools)

    @property
    def size(self) -> int:
        return sum(p.kind.size for p in self.pools)

    @property
    def ready(self) -> int:
        return sum(p.ready for p in self.pools)

    @property
    def held(self) -> int:
        return sum(p.held for p in self.pools)

    @property
    def committed_bytes(self) -> int:
        return sum(p.committed_bytes for p in self.pools)

    @property
    def hits(self) -> int:
        return sum(p.hits for p in self.pools)

    @property
    def misses(self) -> int:
        return sum(p.misses for p in self.pools)

    async def burst_answered(self, gap: float = 0.02, most: float = 0.1) -> None:
        """Return once no create took from a pool for ``gap`` seconds (at most ``most``
        from now): a burst's cold starts begin after its answers went out, so their Docker
        calls (threads that want the GIL, and dockerd's cores) do not delay those answers."""
        deadline = time.monotonic() + most
        while True:
            wait = min(self.demand.last + gap, deadline) - time.monotonic()
            if wait <= 0:
                return
            await asyncio.sleep(wait)

    def session_start(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Around a session's own cold start: refills wait until it is done."""
        return self.demand.hold()

    def start(self) -> None:
        for pool in self.pools:
            pool.start()

    def take(self, limits: Limits, runtime: str | None = None) -> KernelSession | None:
        """A ready kernel for a session with ``limits`` and ``runtime``, or None."""
        for pool in self.pools:
            if pool.matches(limits, runtime):
                return pool.take()
        return None

    def discard(self, kernel: KernelSession) -> None:
        if self.pools:
            self.pools[0].discard(kernel)

    def poke(self) -> None:
        for pool in self.pools:
            pool.poke()

    async def evict(self) -> bool:
        """Stop one pooled sandbox (of the pool holding the most memory); False if none."""
        for pool in sorted(self.pools, key=lambda p: -p.ready * p.kind.limits.memory_bytes):
            if await pool.evict():
                return True
        return False

    async def drain(self) -> int:
        return sum([await pool.drain() for pool in self.pools])

    async def close(self) -> None:
        for pool in self.pools:
            await pool.close()
