"""The warm pool's policy, with a stand-in for starting kernels (the real thing is
exercised end to end by tests/gateway/test_pool.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kernelhub.config import EngineSettings, Limits, Settings
from kernelhub.errors import ConfigError, SandboxStartError
from kernelhub.session import pool as pool_module
from kernelhub.session.pool import (
    POOL_OWNER,
    Demand,
    PoolKind,
    WarmPool,
    WarmPools,
    pool_kinds,
)
from tests.conftest import eventually


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


def _pool(size: int, room: Any = lambda _: True) -> WarmPool:
    return WarmPool(
        backend=None,  # type: ignore[arg-type]
        kind=PoolKind("", size, Limits()),
        engine=EngineSettings(),
        room=room,
        demand=Demand(settle=0),
    )


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_fills_hands_each_sandbox_out_once_and_refills(started: list[FakeKernel]) -> None:
    pool = _pool(2)
    pool.start()
    await _settle()
    assert pool.ready == 2 and {k.spec.owner for k in started} == {POOL_OWNER}
    first = pool.take()
    second = pool.take()
    assert first is not None and second is not None and first is not second
    await _settle()
    assert pool.ready == 2 and len(started) == 4  # refilled with new sandboxes, none reused
    assert not pool.matches(Limits(pids=100), None)  # other limits: the caller starts cold
    assert pool.hits == 2
    await pool.close()
    assert all(k.closed for k in started[2:])  # the pooled ones, not the two handed out
    assert not first.closed and not second.closed  # type: ignore[attr-defined]


async def test_dead_sandboxes_are_discarded_and_room_is_respected(
    started: list[FakeKernel],
) -> None:
    allowed = {"n": 1}
    pool = _pool(
        3, room=lambda memory: memory == Limits().memory_bytes and len(started) < allowed["n"]
    )
    pool.start()
    await _settle()
    assert pool.ready == 1  # the budget allowed one
    started[0].alive = False
    assert pool.take() is None and pool.misses == 1
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


async def test_each_kind_has_its_pool_and_refills_wait_for_sessions_starting(
    started: list[FakeKernel],
) -> None:
    small = Limits(memory_bytes=128 << 20)
    pools = WarmPools(None, EngineSettings(), lambda _: True, settle=0)  # type: ignore[arg-type]
    pools.add(PoolKind("", 1, Limits()))
    pools.add(PoolKind("untrusted", 2, small, "runsc"))
    pools.start()
    await _settle()
    assert pools.ready == 3 and pools.size == 3
    assert {(k.spec.limits, k.spec.runtime) for k in started} == {
        (Limits(), None),
        (small, "runsc"),
    }
    assert pools.take(small, None) is None  # the runtime is part of the kind
    taken = pools.take(small, "runsc")
    assert taken is not None and taken.spec.runtime == "runsc"  # type: ignore[attr-defined]
    async with pools.session_start():  # a session's own sandbox is starting
        assert pools.take(Limits()) is not None
        await _settle()
        assert len(started) == 3  # no refill while it starts
    await _settle()
    assert len(started) == 5 and pools.ready == 3  # then both pools refill
    assert (pools.hits, pools.misses) == (2, 0)
    assert pools.take(Limits(pids=70)) is None and pools.misses == 0  # no pool of that kind
    await pools.close()


def test_profile_pools_take_the_profiles_limits_and_fail_closed() -> None:
    settings = Settings.model_validate(
        {
            "profiles": {"tiers": {"small": {"limits": {"memory_bytes": 1 << 28, "pids": 64}}}},
            "pool": {"size": 2, "profiles": {"small": 3}},
        }
    )
    default, small = pool_kinds(settings, "docker", frozenset({"runc"}))
    assert (default.name, default.size, default.limits) == ("", 2, settings.limits)
    assert (small.name, small.size, small.runtime) == ("small", 3, None)
    assert small.limits.memory_bytes == 1 << 28 and small.limits.pids == 64
    wrong = settings.model_copy(
        update={"pool": settings.pool.model_copy(update={"profiles": {"big": 1}})}
    )
    with pytest.raises(ConfigError, match="KERNELHUB_POOL__PROFILES names the profile 'big'"):
        pool_kinds(wrong, "docker", frozenset({"runc"}))
    gvisor = Settings.model_validate(
        {"profiles": {"tiers": {"g": {"isolation": "gvisor"}}}, "pool": {"profiles": {"g": 1}}}
    )
    with pytest.raises(ConfigError, match=r"KERNELHUB_POOL__PROFILES: .*runsc"):
        pool_kinds(gvisor, "docker", frozenset({"runc"}))


async def test_refills_wait_until_the_burst_has_settled(started: list[FakeKernel]) -> None:
    pools = WarmPools(None, EngineSettings(), lambda _: True, settle=0.2)  # type: ignore[arg-type]
    pools.add(PoolKind("", 2, Limits()))
    pools.start()
    await _settle()
    assert pools.ready == 2  # the first fill does not wait
    assert pools.take(Limits()) is not None
    await _settle()
    assert len(started) == 2  # a take just happened: no refill yet
    await eventually(lambda: len(started) == 3, timeout=5)
    await pools.close()
