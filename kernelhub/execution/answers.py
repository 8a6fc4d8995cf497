"""The running cell's questions and their answers: the kernel's own ``input()`` /
``confirm()`` requests and the host's questions asked through the cell (the egress gate,
``KernelSession.ask``), one on show at a time, each with the human's answer deadline
(``limits.input_timeout``), after which the deadline answers EOF for the human.

Owned by ``KernelSession``, which checks that it is open before calling; the queue of host
questions is the pure ``questions.HostQuestions``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from kernelhub.config import Limits
from kernelhub.errors import KernelhubError, SessionError
from kernelhub.execution.handle import ExecutionHandle
from kernelhub.execution.link import KernelLink
from kernelhub.execution.questions import EOF_ANSWER, HostQuestions
from kernelhub.execution.router import MessageRouter
from kernelhub.execution.timeouts import AnswerDeadline, PauseGate
from kernelhub.models import (
    Event,
    ExecutionStatus,
    InputReplyEvent,
    InputRequestEvent,
    StatusEvent,
)


class InputDesk:
    def __init__(
        self,
        limits: Limits,
        gate: PauseGate,
        *,
        router: Callable[[], MessageRouter],
        link: Callable[[], KernelLink],
        emit: Callable[[ExecutionHandle | None, Event], None],
        next_seq: Callable[[], int],
        notice: Callable[[str, ExecutionHandle], None],
    ) -> None:
        self._limits = limits
        self._gate = gate
        self._router = router
        self._link = link
        self._emit = emit
        self._next_seq = next_seq
        self._notice = notice
        self._deadline = AnswerDeadline()
        self._questions = HostQuestions()

    def answer(self, value: str, answered_by: str) -> None:
        """Answer the question on show (``"\\x04"`` is EOF): the host's, or else the kernel's."""
        if self._gate.paused:
            raise SessionError("the session is paused; resume it before answering")
        active = self._router().active
        if active is None or active.handle.status != ExecutionStatus.AWAITING_INPUT:
            raise SessionError("no cell is waiting for input")
        client = self._link().client
        assert client is not None
        handle = active.handle
        self._deadline.cancel()
        ours = self._questions.answer(value)
        if not ours:
            client.input(value)
        password = handle.awaiting_password and not ours
        self._emit(
            handle,
            InputReplyEvent(
                execution_id=handle.id,
                seq=self._next_seq(),
                value="" if password else value,
                answered_by=answered_by,
                password=password,
            ),
        )
        if self._questions.kernel_waiting:
            # Ours answered, the kernel's own input() still waits: back to it.
            handle.awaiting_password = self._questions.kernel_password
            self.start_deadline(handle)
            status = ExecutionStatus.AWAITING_INPUT
        else:
            status = ExecutionStatus.RUNNING
        self._status(handle, status)
        self._show_question()

    def ask(self, prompt: str) -> asyncio.Future[str]:
        """See ``KernelSession.ask``."""
        active = self._router().active
        if active is None or active.handle.internal is not None:
            raise SessionError("no cell is running to ask on")
        answer = self._questions.add(active.handle, prompt)
        self._show_question()
        return answer

    def kernel_asked(self, handle: ExecutionHandle, event: InputRequestEvent) -> None:
        """The kernel's own input request (the router's ``on_input``)."""
        self._questions.kernel_waiting = True
        self._questions.kernel_password = event.password
        handle.awaiting_password = event.password
        self.start_deadline(handle)
        self._status(handle, ExecutionStatus.AWAITING_INPUT)

    def ended(self, handle: ExecutionHandle) -> None:
        """``handle``'s cell ended: its host questions get EOF (nobody can answer them)."""
        if self._questions:
            self._questions.drop(handle)

    def start_deadline(self, handle: ExecutionHandle) -> None:
        self._deadline.start(self._limits.input_timeout, self._expired, handle)

    def cancel_deadline(self) -> None:
        self._deadline.cancel()

    def _show_question(self) -> None:
        if self._gate.paused:
            return
        active = self._router().active
        question = self._questions.to_show(active.handle if active else None)
        if question is None:
            return
        handle = question.handle
        handle.awaiting_password = False
        self._emit(
            handle,
            InputRequestEvent(execution_id=handle.id, seq=self._next_seq(), prompt=question.prompt),
        )
        self.start_deadline(handle)
        self._status(handle, ExecutionStatus.AWAITING_INPUT)

    def _status(self, handle: ExecutionHandle, status: ExecutionStatus) -> None:
        self._emit(handle, StatusEvent(execution_id=handle.id, seq=self._next_seq(), status=status))

    def _expired(self, handle: ExecutionHandle, timeout: float) -> None:
        active = self._router().active
        if active is None or active.handle is not handle or self._gate.paused:
            return
        self._notice(
            f"no answer within {timeout:g} s; answering for the human (input() raises EOFError, confirm() returns False)",
            handle,
        )
        with contextlib.suppress(KernelhubError):
            self.answer(EOF_ANSWER, "deadline")
