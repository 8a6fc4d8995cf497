"""The host's own questions through a running cell (``KernelSession.ask``): the egress
gate asks "allow api.example.com:443?" where ``confirm()`` would, so every channel that
answers a cell's input answers it too.

Pure bookkeeping, no I/O: a queue of questions, the one on show, and whether the kernel's
own ``input()`` also waits (one question is on show at a time; an answer goes to the one on
show, and the other is shown after it). The engine emits the events.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

EOF_ANSWER = "\x04"


@dataclass(eq=False)
class Question:
    """A question of the host's and the cell (execution handle) it is asked on."""

    handle: Any
    prompt: str
    answer: asyncio.Future[str]
    shown: bool = False


class HostQuestions:
    def __init__(self) -> None:
        self._queue: deque[Question] = deque()
        # The kernel's own input request is unanswered (and whether it was a password).
        self.kernel_waiting = False
        self.kernel_password = False

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, handle: Any, prompt: str) -> asyncio.Future[str]:
        question = Question(handle, prompt, asyncio.get_running_loop().create_future())
        self._queue.append(question)
        return question.answer

    def on_show(self) -> Question | None:
        return self._queue[0] if self._queue and self._queue[0].shown else None

    def answer(self, value: str) -> bool:
        """Give ``value`` to the question on show; False if none is (it is the kernel's)."""
        question = self.on_show()
        if question is None:
            self.kernel_waiting = False
            return False
        self._queue.popleft()
        if not question.answer.done():
            question.answer.set_result(value)
        return True

    def to_show(self, active: Any) -> Question | None:
        """The question to show now on the running cell ``active``, marked shown; None while
        one is on show or the kernel's own waits. Questions of cells that ended are answered
        with EOF."""
        while self._queue and self._queue[0].handle is not active:
            self.drop(self._queue[0].handle)
        if not self._queue or self._queue[0].shown or self.kernel_waiting:
            return None
        self._queue[0].shown = True
        return self._queue[0]

    def drop(self, handle: Any) -> None:
        """The cell ``handle`` ended: its questions get EOF (nobody can answer them)."""
        kept: deque[Question] = deque()
        for question in self._queue:
            if question.handle is handle:
                if not question.answer.done():
                    question.answer.set_result(EOF_ANSWER)
            else:
                kept.append(question)
        self._queue = kept
        self.kernel_waiting = self.kernel_password = False
