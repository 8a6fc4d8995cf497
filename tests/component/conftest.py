from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kernelhub.config import EngineSettings, Limits, Settings
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.base import SandboxBackend, SandboxSpec
from tests.conftest import RUN_INSTANCE, UNIT

SessionFactory = Callable[..., Awaitable[KernelSession]]


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
async def backend(
    request: pytest.FixtureRequest, settings: Settings
) -> AsyncIterator[SandboxBackend]:
    if request.param == "local":
        from kernelhub.sandbox.local import LocalBackend

        b: SandboxBackend = LocalBackend(run_dir=settings.run_dir, instance=RUN_INSTANCE)
    else:
        from kernelhub.sandbox.docker import DockerBackend

        b = DockerBackend(
            image=settings.docker.image, run_dir=settings.run_dir, instance=RUN_INSTANCE
        )
    yield b
    await b.close()


@pytest.fixture
async def open_session(backend: SandboxBackend) -> AsyncIterator[SessionFactory]:
    """Factory: ``await open_session(memory_bytes=…)``; every session is closed after."""
    sessions: list[KernelSession] = []

    async def make(**limits: object) -> KernelSession:
        spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], owner="tests", limits=Limits(**limits))
        engine = EngineSettings(
            interrupt_grace=2 * UNIT, restart_grace=20 * UNIT, start_timeout=60 * UNIT
        )
        session = await KernelSession.start(backend, spec, engine=engine)
        sessions.append(session)
        return session

    yield make
    for session in sessions:
        await session.close()
