"""The warm pool's policy, with a stand-in for starting kernels (the real thing is
exercised end to end by tests/gateway/test_pool.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kernelhub.config import EngineSettings, Limits, PoolSettings
from kernelhub.errors import SandboxStartError
from kernelhub.session import pool as pool_module
from kernelhub.session.pool import POOL_OWNER, WarmPool


class FakeKernel:
    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.alive = True
        self.closed = False

    async def close(self) -> None:
        self.closed = True
        self.alive = False


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[FakeKernel]:
    made: list[FakeKernel] = []

    async def start(backend: Any, spec: Any, **_: Any) -> FakeKernel:
        await asyncio.sleep(0)
        kernel = FakeKernel(spec)
        made.append(kernel)
        return kernel

    monkeypatch.setattr(pool_module.KernelSession, "start", start)
    return made


def _pool(size: int, room: Any = lambda: True) -> WarmPool:
    return WarmPool(
        backend=None,  # type: ignore[arg-type]
        settings=PoolSettings(size=size),
        limits=Limits(),
        engine=EngineSettings(),
        room=room,
    )


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_fills_hands_each_sandbox_out_once_and_refills(started: list[FakeKernel]) -> None:
    pool = _pool(2)
    pool.start()
    await _settle()
    assert pool.ready == 2 and {k.spec.owner for k in started} == {POOL_OWNER}
    first = pool.take(Limits())
    second = pool.take(Limits())
    assert first is not None and second is not None and first is not second
    await _settle()
    assert pool.ready == 2 and len(started) == 4  # refilled with new sandboxes, none reused
    assert pool.take(Limits(pids=100)) is None  # other limits: the caller starts cold
    assert pool.hits == 2
    await pool.close()
    assert all(k.closed for k in started[2:])  # the pooled ones, not the two handed out
    assert not first.closed and not second.closed  # type: ignore[attr-defined]


async def test_dead_sandboxes_are_discarded_and_room_is_respected(
    started: list[FakeKernel],
) -> None:
    allowed = {"n": 1}
    pool = _pool(3, room=lambda: len(started) < allowed["n"])
    pool.start()
    await _settle()
    assert pool.ready == 1  # the budget allowed one
    started[0].alive = False
    assert pool.take(Limits()) is None and pool.misses == 1
    await _settle()
    assert started[0].closed
    allowed["n"] = 4
    pool.poke()
    await _settle()
    assert pool.ready == 3
    assert await pool.evict() and pool.ready == 2
    assert await pool.drain() == 2 and pool.ready == 0
    await pool.close()


async def test_a_failing_start_backs_off_instead_of_spinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0

    async def start(backend: Any, spec: Any, **_: Any) -> Any:
        nonlocal calls
        calls += 1
        raise SandboxStartError("no image; run kernelhub image build")

    monkeypatch.setattr(pool_module.KernelSession, "start", start)
    pool = _pool(2)
    pool.start()
    await asyncio.sleep(0.2)
    assert calls == 1 and pool.ready == 0
    await pool.close()
