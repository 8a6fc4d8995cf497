"""The host's questions through a running cell: the bookkeeping, with data."""

from __future__ import annotations

from kernelhub.execution.questions import EOF_ANSWER, HostQuestions


async def test_one_on_show_at_a_time_and_the_kernels_own_first() -> None:
    q, cell = HostQuestions(), object()
    q.kernel_waiting = True  # the kernel asked first
    first = q.add(cell, "allow a.example.com:443?")
    second = q.add(cell, "allow b.example.com:443?")
    assert q.to_show(cell) is None  # behind the kernel's input()
    assert q.answer("kernel's answer") is False and not q.kernel_waiting
    shown = q.to_show(cell)
    assert shown is not None and shown.prompt.startswith("allow a.")
    assert q.to_show(cell) is None  # one at a time
    assert q.answer("session") is True and first.result() == "session"
    assert q.to_show(cell).prompt.startswith("allow b.")  # type: ignore[union-attr]
    assert q.answer("deny") is True and second.result() == "deny"
    assert not q


async def test_questions_of_an_ended_cell_get_eof() -> None:
    q, old, new = HostQuestions(), object(), object()
    stale = q.add(old, "allow a.example.com:443?")
    fresh = q.add(new, "allow b.example.com:443?")
    shown = q.to_show(new)
    assert stale.result() == EOF_ANSWER and shown is not None and shown.handle is new
    q.drop(new)
    assert fresh.result() == EOF_ANSWER and not q
