"""The host's questions through a running cell (``KernelSession.ask``, the egress gate):
shown as the cell's input requests, answered like ``confirm()``, in turn with the
kernel's own, and answered "no" (EOF) by the deadline or the cell's end."""

from __future__ import annotations

import asyncio

import pytest

from kernelhub.errors import SessionError
from kernelhub.models import ExecutionStatus, InputReplyEvent, InputRequestEvent
from tests.component.conftest import SessionFactory
from tests.conftest import UNIT, eventually


async def test_a_host_question_waits_its_turn_behind_the_kernels_own(
    open_session: SessionFactory,
) -> None:
    s = await open_session()
    handle = await s.submit("a = input('first? ')\nb = input('second? ')\nprint(a, b)")
    await eventually(lambda: handle.status == ExecutionStatus.AWAITING_INPUT, 30)
    answer = s.ask("allow api.example.com:443 for this session? ")
    s.send_input("one")  # the kernel asked first: its answer
    await eventually(
        lambda: any(
            isinstance(e, InputRequestEvent) and "api.example.com" in e.prompt
            for e in handle.events
        ),
        10,
    )
    s.send_input("session", answered_by="alice")
    assert await asyncio.wait_for(answer, 10 * UNIT) == "session"
    await eventually(lambda: handle.status == ExecutionStatus.AWAITING_INPUT, 30)
    s.send_input("two")
    result = await handle.wait()
    assert result.stdout.strip() == "one two"
    replies = [(e.value, e.answered_by) for e in result.events if isinstance(e, InputReplyEvent)]
    assert replies == [("one", "user"), ("session", "alice"), ("two", "user")]


async def test_the_deadline_and_the_cells_end_answer_for_the_human(
    open_session: SessionFactory,
) -> None:
    s = await open_session(input_timeout=1.0 * UNIT)
    handle = await s.submit("import time\nfor _ in range(600):\n    time.sleep(0.01)")
    await eventually(lambda: handle.status == ExecutionStatus.RUNNING, 30)
    assert await asyncio.wait_for(s.ask("allow x.example.com:443? "), 10 * UNIT) == "\x04"
    pending = s.ask("allow y.example.com:443? ")
    await s.interrupt()
    await handle.wait()
    assert await asyncio.wait_for(pending, 10 * UNIT) == "\x04"
    with pytest.raises(SessionError, match="no cell is running"):
        s.ask("allow z.example.com:443? ")
