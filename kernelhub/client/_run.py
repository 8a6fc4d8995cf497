"""``session.run(...)`` with callbacks: the cell goes out as an ``execute`` frame on the
session's event stream, and its events come back to the callbacks in order as they arrive.

:func:`run_streamed` needs of its session only what it is passed: the stream's host (the
hub), the session id, the newest seq the session has seen, a way to fetch an execution,
and where to report each seq seen.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from kernelhub.client._rest import build, call, new_id, to_execution
from kernelhub.client._stream import EventStream, StreamHost
from kernelhub.client.errors import api_error
from kernelhub.models import (
    DisplayEvent,
    Event,
    Execution,
    FinalEvent,
    InputRequestEvent,
    Result,
    ResultEvent,
    StreamEvent,
    result_of,
)
from kernelhub.wire import (
    AcceptedFrame,
    ErrorFrame,
    EventFrame,
    ExecuteFrame,
    ExecutionInfo,
    InputReplyFrame,
)

TextCallback = Callable[[str], object]
"""Called with each chunk of stdout or stderr; may be async (its result is awaited)."""
EventCallback = Callable[[Event], object]
"""Called with every event of the execution, in order; may be async."""
InputCallback = Callable[[str], "str | Awaitable[str]"]
"""Called with the prompt when the cell calls ``input()``; returns the line to send."""
StartCallback = Callable[[str], object]
"""Called with the execution id once the gateway has accepted the cell; may be async."""
ResultCallback = Callable[[Result], object]
"""Called with each rich output (a display, the last expression's value); may be async."""

log = logging.getLogger(__name__)


class Callbacks:
    """The callbacks of one ``run``, dispatched in event order."""

    def __init__(
        self,
        on_stdout: TextCallback | None,
        on_stderr: TextCallback | None,
        on_event: EventCallback | None,
        on_input: InputCallback | None,
        on_start: StartCallback | None,
        on_result: ResultCallback | None,
    ) -> None:
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.on_event = on_event
        self.on_input = on_input
        self.on_start = on_start
        self.on_result = on_result
        self.reply_ids: set[str] = set()

    async def started(self, execution_id: str) -> None:
        if self.on_start is not None:
            await call(self.on_start, execution_id)

    async def dispatch(self, event: Event, stream: EventStream | None, execution_id: str) -> None:
        if self.on_event is not None:
            await call(self.on_event, event)
        if isinstance(event, ResultEvent) or (isinstance(event, DisplayEvent) and not event.update):
            if self.on_result is not None:
                await call(self.on_result, result_of(event))
        elif isinstance(event, StreamEvent):
            callback = self.on_stdout if event.name == "stdout" else self.on_stderr
            if callback is not None:
                await call(callback, event.text)
        elif isinstance(event, InputRequestEvent) and self.on_input is not None and stream:
            value = await call(self.on_input, event.prompt)
            reply = build(
                InputReplyFrame,
                type="input_reply",
                execution_id=execution_id,
                value=value,
                request_id=new_id(),
            )
            assert reply.request_id is not None
            self.reply_ids.add(reply.request_id)
            await stream.send(reply)


async def run_streamed(
    hub: StreamHost,
    session_id: str,
    code: str,
    *,
    timeout: float | None,
    key: str,
    user_key: bool,
    callbacks: Callbacks,
    since: int,
    fetch: Callable[[str], Awaitable[ExecutionInfo]],
    saw: Callable[[int], None],
) -> Execution:
    """Run ``code`` over the event stream opened after ``since``; ``fetch`` gets an
    execution's state, ``saw`` is told each seq that arrives. ``user_key``: the caller
    chose ``key``, which may name an execution from an earlier call."""

    def finished(info: ExecutionInfo) -> Execution:
        execution = to_execution(info)
        if execution.events:
            saw(execution.events[-1].seq)
        return execution

    request_id = new_id()
    execute = build(
        ExecuteFrame,
        type="execute",
        code=code,
        timeout=timeout,
        idempotency_key=key,
        request_id=request_id,
    )
    async with EventStream(hub, session_id, since=since) as stream:
        await stream.open()
        floor = stream.first_hello_seq  # every event up to here predates this request
        await stream.send(execute)
        execution_id: str | None = None
        early: list[Event] = []  # events that arrived before we knew our execution's id
        collected: list[Event] = []
        while True:
            frame = await stream.receive()
            if isinstance(frame, EventFrame):
                saw(frame.event.seq)
                if execution_id is None:
                    if frame.event.seq > floor:
                        early.append(frame.event)
                    continue
                batch = [frame.event] if frame.event.execution_id == execution_id else []
            elif isinstance(frame, AcceptedFrame) and frame.request_id == request_id:
                execution_id = frame.execution_id
                await callbacks.started(execution_id)
                if user_key:
                    # The key may name an execution from an earlier call, whose events
                    # predate this stream: if it has finished, its record says it all.
                    info = await fetch(execution_id)
                    if info.status.is_final:
                        execution = finished(info)
                        for event in execution.events:  # a replay: nothing to answer
                            await callbacks.dispatch(event, None, execution_id)
                        return execution
                batch = [e for e in early if e.execution_id == execution_id]
                early.clear()
            elif isinstance(frame, ErrorFrame) and frame.request_id == request_id:
                raise api_error(None, frame.error, frame.message)
            elif isinstance(frame, ErrorFrame) and frame.request_id in callbacks.reply_ids:
                # Too late (the gateway's input deadline answered first) or refused: the
                # execution's own events tell what happened; watching goes on.
                log.warning("input reply refused: %s: %s", frame.error, frame.message)
                continue
            else:
                continue
            for event in batch:
                collected.append(event)
                assert execution_id is not None
                try:
                    await callbacks.dispatch(event, stream, execution_id)
                except Exception as exc:
                    if isinstance(event, FinalEvent):
                        raise
                    exc.add_note(
                        f"execution {execution_id} keeps running; "
                        f"session.interrupt({execution_id!r}) stops it"
                    )
                    raise
                if isinstance(event, FinalEvent):
                    if user_key:  # it may have started before this stream did
                        return finished(await fetch(execution_id))
                    return Execution(record=event.record, events=collected)
