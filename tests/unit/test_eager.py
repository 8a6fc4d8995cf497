"""kernelhub.eager: a coroutine started in the caller's turn, carried on by a task."""

from __future__ import annotations

import asyncio

import pytest

from kernelhub import eager


async def test_a_coroutine_that_never_suspends_is_done_before_start_returns() -> None:
    ran: list[str] = []

    async def fast() -> int:
        ran.append("body")
        return 42

    fut = eager.start(fast())
    assert ran == ["body"] and fut.done() and fut.result() == 42


async def test_its_error_is_in_the_future_at_once() -> None:
    async def refuse() -> None:
        raise ValueError("no")

    fut = eager.start(refuse())
    assert fut.done() and isinstance(fut.exception(), ValueError)


async def test_one_that_suspends_runs_its_first_part_now_and_the_rest_in_a_task() -> None:
    gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    steps: list[str] = []

    async def slow() -> str:
        steps.append("before")
        got = await gate
        steps.append(got)
        await asyncio.sleep(0)  # a bare turn, then a real await again
        await asyncio.sleep(0.001)
        return got + "!"

    fut = eager.start(slow())
    assert steps == ["before"] and not fut.done()
    gate.set_result("after")
    assert await asyncio.wait_for(fut, 5) == "after!"
    assert steps == ["before", "after"]


async def test_an_error_after_the_suspension_reaches_the_awaiter() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def slow() -> None:
        await gate
        raise KeyError("late")

    fut = eager.start(slow())
    gate.set_result(None)
    with pytest.raises(KeyError):
        await asyncio.wait_for(fut, 5)


async def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cleaned: list[str] = []

    async def slow() -> None:
        try:
            await gate
        finally:
            cleaned.append("finally")

    fut = eager.start(slow())
    await asyncio.sleep(0)
    fut.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fut
    assert cleaned == ["finally"] and gate.cancelled()


async def test_a_cancellation_the_coroutine_survives_lets_it_finish() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def stubborn() -> str:
        try:
            await gate
        except asyncio.CancelledError:
            return "kept going"
        return "not cancelled"

    fut = eager.start(stubborn())
    await asyncio.sleep(0)
    fut.cancel()
    assert await fut == "kept going"
