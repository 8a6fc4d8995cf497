"""kernelhub's own operations in a kernel (capture, restore, remove a checkpoint): the
request to send, how to read its answer (pure), and :func:`run`, which picks the way.

An image that advertises ``kernelhub_calls`` in its ``kernel_info_reply`` answers a
``kernelhub_call_request`` with a shell handler of its own
(``kernelhub_kernel.calls`` in the image): no IPython ``run_cell``, which was most of a
checkpoint's kernel CPU. Any other kernel gets the same operation as kernelhub's own
source in a silent ``execute_request`` (:attr:`KernelOp.code`), as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from kernelhub.errors import KernelError

if TYPE_CHECKING:
    from kernelhub.execution.engine import KernelSession

REQUEST = "kernelhub_call_request"
REPLY = "kernelhub_call_reply"
INFO_KEY = "kernelhub_calls"
# What this gateway speaks; a kernel advertising a newer version still speaks this one.
VERSION = 1
RESULT_EXPRESSION = "result"


class KernelOp(NamedTuple):
    """One operation: ``op`` and ``args`` for a kernel that takes the request; ``code``
    (and ``result``, the expression whose value is its result, or None when the caller
    wants none) for one that does not."""

    op: str
    args: dict[str, Any]
    code: str
    result: str | None = None

    def request(self) -> dict[str, Any]:
        """The ``kernelhub_call_request`` content."""
        return {"op": self.op, "args": self.args, "result": self.result is not None}

    def expressions(self) -> dict[str, str]:
        """The ``user_expressions`` of the fallback execute."""
        return {} if self.result is None else {RESULT_EXPRESSION: self.result}


def supported(kernel_info: Mapping[str, Any]) -> bool:
    """Whether the kernel said it answers ``kernelhub_call_request``."""
    version = kernel_info.get(INFO_KEY)
    return isinstance(version, int) and not isinstance(version, bool) and version >= VERSION


def reply_result(content: Mapping[str, Any]) -> dict[str, Any]:
    """The result of an ``ok`` reply (``{}`` when none was asked for)."""
    result = content.get("result", {})
    if not isinstance(result, dict):
        raise KernelError("the kernel's call result is not a JSON object")
    return result


def expression_result(op: KernelOp, answers: Mapping[str, Any]) -> dict[str, Any]:
    """The result of the fallback execute, from its ``user_expressions`` answers."""
    if op.result is None:
        return {}
    answer = answers.get(RESULT_EXPRESSION)
    if not isinstance(answer, dict) or answer.get("status") != "ok":
        detail = answer.get("evalue") if isinstance(answer, dict) else answer
        raise KernelError(f"the kernel did not report a result for {op.op}: {detail}")
    data = answer.get("data", {})
    value = data.get("application/json") if isinstance(data, dict) else None
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise KernelError(f"the kernel's {op.op} result is not a JSON object")
    return value


async def run(
    kernel: KernelSession, op: KernelOp, *, timeout: float | None, background: bool = False
) -> dict[str, Any]:
    """Run ``op`` in ``kernel`` as ``KernelSession.call`` runs code (in turn with the cells,
    silently, ``KernelError`` with the kernel's traceback if it fails): by its own request
    if the kernel advertises it, else as source. Returns its result (``{}`` when
    ``op.result`` is None)."""
    if supported(kernel.kernel_info):
        reply = await kernel.call(
            op.op, {}, timeout=timeout, background=background, request=op.request()
        )
        return reply_result(reply)
    answers = await kernel.call(op.code, op.expressions(), timeout=timeout, background=background)
    return expression_result(op, answers)
