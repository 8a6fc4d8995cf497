"""The kernel's handler of ``kernelhub_call_request`` (``kernelhub_kernel/calls.py``):
its replies, and how it installs on a kernel. The operations themselves run in real
kernels (tests/docker/test_kernel_calls.py, the component snapshot tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.kernel_image.loader import load

calls = load("calls")


def test_an_unknown_op_or_bad_args_is_an_error_reply_not_an_exception() -> None:
    unknown = calls.answer({"op": "exec", "args": {"code": "1"}})
    assert unknown["status"] == "error" and unknown["ename"] == "ValueError"
    assert "unknown kernelhub call 'exec'" in unknown["evalue"]
    bad = calls.answer({"op": "remove", "args": {"name": "../../etc"}})
    assert bad["status"] == "error" and "alphanumeric" in bad["evalue"]
    extra = calls.answer({"op": "remove", "args": {"name": "x", "path": "/"}})
    assert extra["ename"] == "TypeError"
    assert all(isinstance(line, str) for line in extra["traceback"])


def test_remove_deletes_a_snapshot_directory_and_asks_for_no_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELHUB_SNAPSHOTS", str(tmp_path))
    (tmp_path / "ckpt-1" / "groups").mkdir(parents=True)
    reply = calls.answer({"op": "remove", "args": {"name": "ckpt-1"}, "result": False})
    assert reply == {"status": "ok", "result": {}}
    assert not (tmp_path / "ckpt-1").exists()


def test_an_interrupt_inside_an_op_is_its_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(name: str) -> dict[str, Any]:
        raise KeyboardInterrupt

    monkeypatch.setitem(calls.OPERATIONS, "remove", interrupted)
    reply = calls.answer({"op": "remove", "args": {"name": "x"}})
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    json.dumps(reply)  # what the session sends


class Kernel:
    """What ``install`` touches of an ipykernel Kernel."""

    sent: list[tuple[str, dict[str, Any]]]

    def __init__(self) -> None:
        self.shell_handlers: dict[str, Any] = {}
        self.sent = []
        self.session = self

    @property
    def kernel_info(self) -> dict[str, Any]:
        return {"implementation": "ipython"}

    def send(self, stream: Any, msg_type: str, content: dict[str, Any], *rest: Any) -> None:
        self.sent.append((msg_type, content))


def test_install_handles_the_request_and_advertises_it_unless_switched_off() -> None:
    assert not calls.install(Kernel(), {"KERNELHUB_KERNEL_CALLS": "0"})
    kernel = Kernel()
    assert calls.install(kernel, {})
    assert kernel.kernel_info == {"implementation": "ipython", "kernelhub_calls": 1}
    handler = kernel.shell_handlers["kernelhub_call_request"]
    handler(None, [], {"content": {"op": "nope", "args": {}}})
    assert kernel.sent[0][0] == "kernelhub_call_reply"
    assert kernel.sent[0][1]["status"] == "error"
