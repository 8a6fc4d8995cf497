"""The warm pool: sandboxes with running kernels, started before anyone asks for them.

A session created with the pool's limits takes one (a dict pop, no Docker call) instead of
waiting for a container and a kernel to come up. Each pooled sandbox is handed out once
and never returned: a sandbox that ran somebody's code is never seen by anybody else.

Pooled sandboxes carry the session id they will have (the id is in their labels, socket
directory and state directory) and the owner label :data:`POOL_OWNER`; the real owner is
recorded in the store when a session takes one. They are not re-adopted after a gateway
restart (nobody owns them): start-up reaps them with the other orphans and the pool refills.

Contract: the manager calls ``start()`` once after reaping orphans, ``take()`` on every
create, ``drain()`` for the emergency stop and ``close()`` at shutdown. ``room()`` (given
by the manager) says whether the host's budgets allow one more sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable

from kernelhub.config import EngineSettings, Limits, PoolSettings
from kernelhub.errors import KernelhubError
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.base import SandboxBackend, SandboxSpec

log = logging.getLogger(__name__)

POOL_OWNER = "kernelhub-pool"
_RETRY_INTERVAL = 2.0  # after a failed start; doubles up to _RETRY_MAX
_RETRY_MAX = 60.0


class WarmPool:
    def __init__(
        self,
        backend: SandboxBackend,
        settings: PoolSettings,
        limits: Limits,
        engine: EngineSettings,
        room: Callable[[], bool],
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.limits = limits
        self.engine = engine
        self.room = room
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
        return self.held * self.limits.memory_bytes

    def start(self) -> None:
        if self.settings.size > 0 and self._task is None:
            self._task = asyncio.create_task(self._refill(), name="kernelhub-warm-pool")
            self._wanted.set()

    def take(self, limits: Limits) -> KernelSession | None:
        """A ready kernel for a session with ``limits``, or None (the caller starts one
        cold). Never blocks."""
        if limits != self.limits:
            return None
        while self._ready:
            kernel = self._ready.popleft()
            self._wanted.set()
            if kernel.alive:
                self.hits += 1
                return kernel
            self.discard(kernel)
        if self.settings.size > 0:
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
        return self.settings.size - len(self._ready) - self._starting

    async def _refill(self) -> None:
        backoff = _RETRY_INTERVAL
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            while self._short() > 0 and self.room():
                batch = min(self._short(), self.settings.refill_concurrency)
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
                        "warm pool: a sandbox failed to start (%s); retrying in %.0f s",
                        failures[0], backoff,
                    )  # fmt: skip
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _RETRY_MAX)
                else:
                    backoff = _RETRY_INTERVAL

    async def _start_one(self) -> KernelSession:
        t0 = time.monotonic()
        spec = SandboxSpec(session_id=uuid.uuid4().hex[:16], owner=POOL_OWNER, limits=self.limits)
        kernel = await KernelSession.start(self.backend, spec, engine=self.engine)
        log.debug("warm pool: sandbox %s ready in %.2f s", spec.session_id, time.monotonic() - t0)
        return kernel
