"""The async SDK's :class:`AsyncSession`: one kernel on a gateway.

REST calls go through the hub's one request loop (``AsyncHub._request``); live output
through the session's event stream (:class:`~kernelhub.client._stream.EventStream`), for
:meth:`AsyncSession.events` here and for ``run`` with callbacks in :mod:`._run`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from types import TracebackType
from typing import TYPE_CHECKING, Self
from urllib.parse import quote

import httpx

from kernelhub.client._files import FileInfo, UploadData, Writable, file_path, save, upload_body
from kernelhub.client._rest import POLL_INTERVAL_MAX, build, new_id, parse, to_execution
from kernelhub.client._run import (
    Callbacks,
    EventCallback,
    InputCallback,
    ResultCallback,
    StartCallback,
    TextCallback,
    run_streamed,
)
from kernelhub.client._stream import EventStream
from kernelhub.client.errors import NotFoundError, SessionEndedError
from kernelhub.models import Event, Execution
from kernelhub.wire import (
    EventFrame,
    ExecutionCreate,
    ExecutionInfo,
    RewindReport,
    SessionInfo,
    SnapshotInfo,
)

if TYPE_CHECKING:
    from kernelhub.client._hub import AsyncHub


class AsyncSession:
    """One stateful kernel. Variables live across :meth:`run` calls::

        await session.run("x = 1")
        await session.run("print(x)", on_stdout=print)

    Leaving ``async with session:`` deletes the session.
    """

    def __init__(self, hub: AsyncHub, info: SessionInfo) -> None:
        self.hub = hub
        self.last_info = info
        self._last_seq = info.last_seq

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r}, state={self.last_info.state.value!r})"

    @property
    def id(self) -> str:
        return self.last_info.id

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Delete the session; one that is already gone is fine."""
        with contextlib.suppress(NotFoundError, SessionEndedError):
            await self.delete()

    @property
    def _path(self) -> str:
        return f"/v1/sessions/{quote(self.id, safe='')}"

    def _saw(self, seq: int) -> None:
        self._last_seq = max(self._last_seq, seq)

    async def info(self) -> SessionInfo:
        """Fetch the session's current state (also kept in :attr:`last_info`)."""
        self.last_info = parse(SessionInfo, await self.hub._request("GET", self._path))
        self._saw(self.last_info.last_seq)
        return self.last_info

    async def delete(self, *, purge: bool = False) -> None:
        """Stop the kernel and remove the session. Its history is kept for the gateway's
        retention period; ``purge`` deletes it now (and frees its storage quota)."""
        try:
            await self.hub._request("DELETE", self._path + ("?purge=true" if purge else ""))
        except (NotFoundError, SessionEndedError):
            await self.hub._release(self)
            raise
        await self.hub._release(self)

    # -- executions --------------------------------------------------------------------

    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
        on_event: EventCallback | None = None,
        on_input: InputCallback | None = None,
        on_start: StartCallback | None = None,
        on_result: ResultCallback | None = None,
        idempotency_key: str | None = None,
    ) -> Execution:
        """Run ``code`` and return the finished :class:`Execution`.

        ``timeout`` is the cell's limit in seconds (None: the session's). A failing cell is
        not an exception: look at ``execution.error``; its rich outputs are
        ``execution.results``. With any callback, output streams over the WebSocket and
        callbacks are called in order as it arrives (they may be async): ``on_start(id)``
        as soon as the gateway has accepted the cell (keep the id to :meth:`interrupt` it
        from another task or thread), ``on_result(result)`` for each display and the
        value; ``on_input(prompt)`` answers ``input()`` — without it, a cell that asks
        waits for :meth:`send_input` or its timeout. Without callbacks this is one REST
        request. A fresh idempotency key is generated unless given, so the SDK's retries
        and reconnects never run the code twice. Cancelling ``run`` or a callback raising
        stops watching, not the execution: call :meth:`interrupt`.
        """
        user_key = idempotency_key is not None
        key = idempotency_key or new_id()
        given = (on_stdout, on_stderr, on_event, on_input, on_start, on_result)
        if any(cb is not None for cb in given):
            return await run_streamed(
                self.hub,
                self.id,
                code,
                timeout=timeout,
                key=key,
                user_key=user_key,
                callbacks=Callbacks(*given),
                since=self._last_seq,
                fetch=self.get_execution,
                saw=self._saw,
            )
        body = build(ExecutionCreate, code=code, timeout=timeout, wait=True, idempotency_key=key)
        response = await self.hub._request(
            "POST",
            f"{self._path}/executions",
            json=body.model_dump(mode="json", exclude_none=True),
            # The gateway ends every execution by its cell timeout; only connecting is bounded.
            timeout=httpx.Timeout(self.hub.timeout, read=None),
            replay_safe=True,
        )
        info = parse(ExecutionInfo, response)
        if info.status.is_final and info.events is not None:
            return self._finished(info)
        return await self.wait(info.id)

    async def submit(
        self, code: str, *, timeout: float | None = None, idempotency_key: str | None = None
    ) -> ExecutionInfo:
        """Queue ``code`` and return at once (status queued or running); see :meth:`wait`."""
        body = build(
            ExecutionCreate,
            code=code,
            timeout=timeout,
            wait=False,
            idempotency_key=idempotency_key or new_id(),
        )
        response = await self.hub._request(
            "POST",
            f"{self._path}/executions",
            json=body.model_dump(mode="json", exclude_none=True),
            replay_safe=True,
        )
        return parse(ExecutionInfo, response)

    async def get_execution(self, execution_id: str) -> ExecutionInfo:
        """The execution's state; ``events`` is filled in once it has finished."""
        response = await self.hub._request(
            "GET", f"/v1/executions/{quote(execution_id, safe='')}", replay_safe=True
        )
        return parse(ExecutionInfo, response)

    async def wait(self, execution_id: str) -> Execution:
        """Poll until the execution has finished, then return it."""
        delay = 0.05
        while True:
            info = await self.get_execution(execution_id)
            if info.status.is_final and info.events is not None:
                return self._finished(info)
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_INTERVAL_MAX)

    async def interrupt(self, execution_id: str) -> None:
        """Send KeyboardInterrupt to a running execution; variables are kept."""
        await self.hub._request("POST", f"/v1/executions/{quote(execution_id, safe='')}/interrupt")

    async def snapshot(self) -> SnapshotInfo:
        """Capture the variables and /workspace files (inside the sandbox); returns what
        was saved and, by name with the reason, what was not."""
        response = await self.hub._request(
            "POST", f"/v1/sessions/{quote(self.id, safe='')}/snapshots"
        )
        return parse(SnapshotInfo, response)

    async def rewind(self, before_cell: int) -> RewindReport:
        """Undo cell ``before_cell`` and everything after it (sessions created with
        ``checkpoints``): the kernel comes back as it was before that cell."""
        response = await self.hub._request(
            "POST",
            f"/v1/sessions/{quote(self.id, safe='')}/rewind",
            json={"before_cell": before_cell},
        )
        return parse(RewindReport, response)

    async def pause(self) -> SessionInfo:
        """Freeze the whole sandbox: no CPU, the running cell shows ``paused`` and its
        timeout stops; execute/interrupt answer 409 until :meth:`resume`."""
        response = await self.hub._request("POST", f"/v1/sessions/{quote(self.id, safe='')}/pause")
        self.last_info = parse(SessionInfo, response)
        return self.last_info

    async def resume(self) -> SessionInfo:
        """Thaw a paused session; the cell continues exactly where it stopped."""
        response = await self.hub._request("POST", f"/v1/sessions/{quote(self.id, safe='')}/resume")
        self.last_info = parse(SessionInfo, response)
        return self.last_info

    async def cancel(self, execution_id: str) -> ExecutionInfo:
        """Drop a queued execution before it starts."""
        response = await self.hub._request(
            "POST", f"/v1/executions/{quote(execution_id, safe='')}/cancel"
        )
        return parse(ExecutionInfo, response)

    async def send_input(self, execution_id: str, value: str) -> None:
        """Answer the ``input()`` an execution is waiting on."""
        await self.hub._request(
            "POST", f"/v1/executions/{quote(execution_id, safe='')}/input", json={"value": value}
        )

    async def notebook(self, *, html: bool = False) -> bytes:
        """The session's executions so far as a Jupyter notebook (``.ipynb`` JSON), or with
        ``html`` as one self-contained, script-free HTML page."""
        response = await self.hub._request(
            "GET", f"{self._path}/notebook?format={'html' if html else 'ipynb'}", replay_safe=True
        )
        return response.content

    async def events(self, since: int = 0) -> AsyncGenerator[Event, None]:
        """Every event of every execution in this session with ``seq > since``, then live
        ones, each exactly once and in order, across reconnects. Ends when the session is
        deleted or ends. Close it when done:
        ``async with contextlib.aclosing(session.events()) as it: async for event in it``.
        """
        async with EventStream(self.hub, self.id, since) as stream:
            while True:
                try:
                    frame = await stream.receive()
                except SessionEndedError:
                    return
                except NotFoundError:
                    if stream.ever_connected:
                        return  # it was there, and is gone: deleted
                    raise
                if isinstance(frame, EventFrame):
                    self._saw(frame.event.seq)
                    yield frame.event

    def _finished(self, info: ExecutionInfo) -> Execution:
        execution = to_execution(info)
        if execution.events:
            self._saw(execution.events[-1].seq)
        return execution

    # -- files -------------------------------------------------------------------------

    async def upload(self, path: str, data: UploadData) -> FileInfo:
        """Write a file into the session's workspace. ``data`` is bytes, a (sync or async)
        iterable of byte chunks, or a binary file object; chunks are streamed, not buffered.
        """
        response = await self.hub._request(
            "PUT", file_path(self._path, path), content=upload_body(data), replay_safe=True
        )
        return parse(FileInfo, response)

    async def download(self, path: str) -> bytes:
        """Read a whole file from the session's workspace into memory."""
        response = await self.hub._request("GET", file_path(self._path, path), replay_safe=True)
        return response.content

    async def download_to(self, path: str, file: Writable) -> int:
        """Stream a file from the workspace into ``file`` (sync or async); returns its size."""
        response = await self.hub._request(
            "GET", file_path(self._path, path), replay_safe=True, stream=True
        )
        return await save(response, file, f"{path!r} from session {self.id}")
