"""kernelhub's engine (``KernelSession``) in-process, timed the way the floors are.

The engine is what the gateway adds to, so it is both a measurement (against the
jupyter_client floor) and the floor of the gateway's own numbers.
"""

from __future__ import annotations

import time
import uuid

from floor import FIRST_PRINT

from kernelhub.config import Limits
from kernelhub.execution.engine import KernelSession
from kernelhub.models import ExecutionStatus, StreamEvent
from kernelhub.sandbox.base import SandboxBackend, SandboxSpec


async def start(backend: SandboxBackend, limits: Limits | None = None) -> KernelSession:
    spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], limits=limits or Limits())
    return await KernelSession.start(backend, spec)


async def cold_start(backend: SandboxBackend) -> float:
    """Seconds from create to a ready kernel (the close after it is not timed)."""
    t0 = time.perf_counter()
    session = await start(backend)
    elapsed = time.perf_counter() - t0
    await session.close()
    return elapsed


async def roundtrip(session: KernelSession, code: str = "1+1") -> float:
    t0 = time.perf_counter()
    result = await session.execute(code)
    elapsed = time.perf_counter() - t0
    assert result.status == ExecutionStatus.COMPLETED, result.record
    return elapsed


async def first_print(session: KernelSession) -> float:
    """Seconds from submitting :data:`floor.FIRST_PRINT` to its first stream event."""
    t0 = time.perf_counter()
    first = None
    async for event in session.stream(FIRST_PRINT):
        if isinstance(event, StreamEvent) and first is None:
            first = time.perf_counter() - t0
    assert first is not None
    return first
