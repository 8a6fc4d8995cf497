"""Start a coroutine in the caller's turn of the event loop: Python 3.12's eager tasks,
for 3.11 too.

One async API serves callers that can wait and callers that cannot (a WebSocket's
receive callback, which must not give the kernel's request to the next loop turn): the
coroutine runs at once, synchronously, up to its first real suspension. If it finishes
without one (the fast case: an idle kernel, nothing to look up) the returned future is
already done; otherwise a task carries on from where it stopped.
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def start(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):  # pragma: no cover - the 3.11 path is the one tested
        return asyncio.eager_task_factory(loop, coro)
    try:
        pending = coro.send(None)
    except StopIteration as stop:
        done: asyncio.Future[T] = loop.create_future()
        done.set_result(stop.value)
        return done
    except Exception as exc:
        failed: asyncio.Future[T] = loop.create_future()
        failed.set_exception(exc)
        return failed
    return loop.create_task(_finish(coro, pending))


async def _finish(coro: Coroutine[Any, Any, T], pending: Any) -> T:
    return await _resume(coro, pending)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, T], pending: Any) -> Generator[Any, None, T]:
    """The rest of ``coro``, which waits on ``pending`` (what it yielded to its task: a
    future, or None for a bare turn). What the task throws in while it waits (a
    cancellation) goes to the coroutine, at the await where it stopped."""
    while True:
        try:
            yield pending
        except BaseException as exc:
            try:
                pending = coro.throw(exc)
            except StopIteration as stop:
                result: T = stop.value
                return result
            continue
        rest: T = yield from coro
        return rest
