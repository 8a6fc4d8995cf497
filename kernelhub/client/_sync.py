"""The sync SDK: :class:`Hub` and :class:`Session`, derived from the async one.

Nothing here talks to the gateway. A :class:`Hub` owns a private event loop on a daemon
thread (the *portal*) and an :class:`~kernelhub.client.AsyncHub` living on it. Each public
method is one line, ``run = _forward(AsyncSession.run)``: calling it runs the async method
on the portal and blocks until it is done, so signatures, docs and behaviour come from the
async class and cannot drift. Async iterators become blocking iterators, one item per
round trip.

Callbacks run on the calling thread. Every callable argument (``on_stdout``, ``on_input``
...) is relayed: the portal hands each call back to the thread blocked in the method,
which runs it and returns the value — so a callback may block (``on_input=input``), use
thread-local state, or call the sync API itself. An exception in a callback propagates
out of the method; Ctrl-C stops watching (the execution keeps running; interrupt it).
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

import httpx

from kernelhub.client._async import AsyncHub, AsyncSession
from kernelhub.client.errors import ClientError
from kernelhub.wire import SessionInfo

__all__ = ["Hub", "Session"]

A = TypeVar("A")
P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
_END = object()


class _Portal:
    """An event loop on its own thread, and the one way to run coroutines on it.
    ``last_words`` runs on the loop once it is stopped, before it closes.

    Not anyio's ``BlockingPortal`` (considered, issue #18): it is a context manager whose
    exit joins its thread, and a Hub's lifetime is not a block: its finalizer runs where
    the last reference drops, which may be the portal's own thread (a callback dropping
    the Hub), where joining is impossible. And what this class is mostly for, relaying
    callbacks back to the calling thread, it does not offer; it would sit on top anyway.
    """

    def __init__(self, last_words: Callable[[], Awaitable[None]] | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._last_words = last_words
        self._thread = threading.Thread(target=self._serve, name="kernelhub-portal", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            if self._last_words is not None:
                loop.run_until_complete(self._last_words())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def call(self, fn: Callable[..., Awaitable[R]], /, *args: Any, **kwargs: Any) -> R:
        """Run ``fn(*args, **kwargs)`` on the portal; block until done. Callable arguments
        are relayed so that they run on this (the calling) thread."""
        if threading.current_thread() is self._thread:
            raise ClientError(
                "the sync kernelhub API was called on its own event loop thread (from an "
                "async callback?); use AsyncHub in async code"
            )
        if self._closed:
            raise ClientError("this Hub is closed; create a new Hub")
        calls: queue.SimpleQueue[_Relayed | None] = queue.SimpleQueue()
        args = tuple(self._relay(value, calls) for value in args)
        kwargs = {name: self._relay(value, calls) for name, value in kwargs.items()}
        future = asyncio.run_coroutine_threadsafe(_await(fn(*args, **kwargs)), self._loop)
        future.add_done_callback(lambda _: calls.put(None))
        try:
            while (relayed := calls.get()) is not None:
                relayed.run()
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C, or a callback raised it: stop the coroutine too
            raise

    def _relay(self, value: Any, calls: queue.SimpleQueue[_Relayed | None]) -> Any:
        if not callable(value) or isinstance(value, type):
            return value
        loop = self._loop

        async def on_calling_thread(*args: Any) -> Any:
            done: asyncio.Future[Any] = loop.create_future()
            calls.put(_Relayed(value, args, done, loop))
            result = await done
            if asyncio.iscoroutine(result):  # an async callback: it runs here, on the portal
                result = await result
            return result

        return on_calling_thread

    def stop(self) -> None:
        """Stop the loop (cancelling whatever still runs on it) and its thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join()


class _Relayed:
    """One callback call, handed from the portal to the calling thread."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        done: asyncio.Future[Any],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.fn, self.args, self.done, self.loop = fn, args, done, loop

    def run(self) -> None:
        try:
            value = self.fn(*self.args)
        except Exception as exc:
            self.loop.call_soon_threadsafe(_settle, self.done, None, exc)
        else:
            self.loop.call_soon_threadsafe(_settle, self.done, value, None)


def _settle(done: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if done.done():
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(value)


async def _await(awaitable: Awaitable[R]) -> R:
    return await awaitable


async def _next_or_end(iterator: AsyncIterator[R]) -> R | object:
    try:
        return await anext(iterator)
    except StopAsyncIteration:
        return _END


class SyncIterator(Generic[T]):
    """A blocking iterator over an async one on the portal. Close it (or use ``with``)
    when you stop early; otherwise its socket stays open until the hub closes."""

    def __init__(self, portal: _Portal, iterator: AsyncIterator[T]) -> None:
        self._portal = portal
        self._iterator = iterator
        self._closed = False

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> T:
        if self._closed:
            raise StopIteration
        item = self._portal.call(_next_or_end, self._iterator)
        if item is _END:
            self._closed = True
            raise StopIteration
        return item  # type: ignore[return-value]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        aclose = getattr(self._iterator, "aclose", None)
        if aclose is not None:
            self._portal.call(aclose)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Twin(Generic[A]):
    """A sync object: the async one it drives, and the portal that runs it."""

    def __init__(self, inner: A, portal: _Portal) -> None:
        self._async = inner
        self._portal = portal

    def _check_open(self) -> None:
        """Raise if this object may no longer be used (a closed Hub)."""


class _Forward(Generic[A, P, T]):
    """A sync method derived from an async one; built by :func:`_forward` and friends."""

    def __init__(
        self,
        invoke: Callable[[_Twin[A], tuple[Any, ...], dict[str, Any]], T],
        source: Callable[..., Any],
    ) -> None:
        self._invoke = invoke
        self._source = source
        self.__doc__ = source.__doc__

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, obj: _Twin[A], owner: type[Any]) -> Callable[P, T]: ...
    def __get__(self, obj: _Twin[A] | None, owner: type[Any]) -> Self | Callable[P, T]:
        if obj is None:
            return self
        invoke = self._invoke

        # Bound to ``obj`` itself, not only its parts: ``Hub(url, token).list_sessions()``
        # keeps the temporary Hub (and so its portal) alive until the call returns.
        @functools.wraps(self._source, assigned=("__name__", "__qualname__", "__doc__"))
        def method(*args: P.args, **kwargs: P.kwargs) -> T:
            obj._check_open()
            return invoke(obj, args, kwargs)

        return method


def _forward(fn: Callable[Concatenate[A, P], Awaitable[R]]) -> _Forward[A, P, R]:
    """``fn`` run on the portal, same arguments, same result."""
    return _Forward(lambda twin, a, k: twin._portal.call(fn, twin._async, *a, **k), fn)


def _forward_as(
    fn: Callable[Concatenate[A, P], Awaitable[R]], wrap: Callable[[R, Any], T]
) -> _Forward[A, P, T]:
    """``fn`` run on the portal, its async result wrapped in its sync twin, which is given
    the object it came from (a Session keeps its Hub, and so the portal, alive)."""
    return _Forward(lambda twin, a, k: wrap(twin._portal.call(fn, twin._async, *a, **k), twin), fn)


def _forward_iter(
    fn: Callable[Concatenate[A, P], AsyncIterator[R]],
) -> _Forward[A, P, SyncIterator[R]]:
    """An async-generator method as a blocking iterator."""
    return _Forward(lambda twin, a, k: SyncIterator(twin._portal, fn(twin._async, *a, **k)), fn)


class Session(_Twin[AsyncSession]):
    """One stateful kernel, blocking API; see :class:`~kernelhub.client.AsyncSession`.

    Callbacks given to :meth:`run` run on the thread that called it. Leaving
    ``with session:`` deletes the session. A session keeps its :class:`Hub`'s background
    thread and connections alive, even past ``hub.close()``, until it is deleted and gone.
    """

    def __init__(self, inner: AsyncSession, hub: Hub) -> None:
        super().__init__(inner, hub._portal)
        self.hub = hub
        hub._sessions.add(self)

    def __repr__(self) -> str:
        return f"Session({self.id!r}, state={self.last_info.state.value!r})"

    @property
    def id(self) -> str:
        return self._async.id

    @property
    def last_info(self) -> SessionInfo:
        return self._async.last_info

    info = _forward(AsyncSession.info)
    delete = _forward(AsyncSession.delete)
    run = _forward(AsyncSession.run)
    submit = _forward(AsyncSession.submit)
    get_execution = _forward(AsyncSession.get_execution)
    wait = _forward(AsyncSession.wait)
    interrupt = _forward(AsyncSession.interrupt)
    pause = _forward(AsyncSession.pause)
    snapshot = _forward(AsyncSession.snapshot)
    rewind = _forward(AsyncSession.rewind)
    resume = _forward(AsyncSession.resume)
    cancel = _forward(AsyncSession.cancel)
    send_input = _forward(AsyncSession.send_input)
    events = _forward_iter(AsyncSession.events)
    notebook = _forward(AsyncSession.notebook)
    upload = _forward(AsyncSession.upload)
    download = _forward(AsyncSession.download)
    download_to = _forward(AsyncSession.download_to)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._portal.call(self._async.__aexit__, exc_type, exc, tb)


class Hub(_Twin[AsyncHub]):
    """One kernelhub gateway, blocking API; see :class:`~kernelhub.client.AsyncHub` for
    the arguments. Owns a background thread until :meth:`close` (or ``with Hub(...)``).
    ``transport`` is an *async* httpx transport: it runs on that thread.
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: float | None = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_retries: int = 2,
        max_reconnects: int = 5,
    ) -> None:
        inner = AsyncHub(
            base_url,
            token,
            timeout=timeout,
            transport=transport,
            max_retries=max_retries,
            max_reconnects=max_reconnects,
        )
        super().__init__(inner, _Portal(last_words=inner._shutdown))
        self._closed = False
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        # Runs when the Hub and every Session it gave out are gone (they refer to it).
        self._finalizer = weakref.finalize(self, self._portal.stop)

    def __repr__(self) -> str:
        return f"Hub({self._async.base_url!r})"

    create_session = _forward_as(AsyncHub.create_session, Session)
    session = _forward_as(AsyncHub.session, Session)
    list_sessions = _forward(AsyncHub.list_sessions)
    health = _forward(AsyncHub.health)
    submit_batch = _forward(AsyncHub.submit_batch)
    get_batch = _forward(AsyncHub.get_batch)
    list_batches = _forward(AsyncHub.list_batches)
    cancel_batch = _forward(AsyncHub.cancel_batch)
    wait_batch = _forward(AsyncHub.wait_batch)
    run_batch = _forward(AsyncHub.run_batch)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClientError("this Hub is closed; create a new Hub")

    def close(self) -> None:
        """Close the hub: its methods then raise "this Hub is closed". Sessions stay alive
        on the gateway, and Session objects it gave out keep working (and keep its thread
        and connections) until deleted; with none left, the thread stops now. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._finalizer.alive:
            return
        try:
            self._portal.call(self._async.close)
        finally:
            if not self._sessions:
                self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
