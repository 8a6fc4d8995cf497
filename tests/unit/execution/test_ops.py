"""kernelhub's own operations: which way they go, and how their answers are read."""

from __future__ import annotations

import pytest

from kernelhub.errors import KernelError
from kernelhub.execution import ops
from kernelhub.execution.collector import OutputCollector
from kernelhub.snapshot import calls


def test_only_a_kernel_that_advertises_calls_gets_the_request() -> None:
    assert ops.supported({"kernelhub_calls": 1})
    assert ops.supported({"kernelhub_calls": 2})  # a newer kernel still speaks version 1
    for info in ({}, {"kernelhub_calls": 0}, {"kernelhub_calls": True}, {"kernelhub_calls": "1"}):
        assert not ops.supported(info), info


def test_an_operation_names_its_op_and_carries_its_fallback_source() -> None:
    op = calls.capture("ckpt-2", "ckpt-1")
    assert op.request() == {
        "op": "capture",
        "args": {"name": "ckpt-2", "base": "ckpt-1"},
        "result": False,  # a checkpoint asks for no result
    }
    assert "capture(" in op.code and op.expressions() == {}
    wanted = calls.restore_stream("restore-1")
    assert wanted.request()["result"] is True and set(wanted.expressions()) == {"result"}
    assert calls.restore("ckpt-1", 4).request()["args"] == {"name": "ckpt-1", "execution_count": 4}
    with pytest.raises(ValueError, match="alphanumeric"):
        calls.remove("../etc")


def test_results_of_both_ways_read_the_same() -> None:
    op = calls.capture_stream("snap-1")
    assert ops.reply_result({"status": "ok", "result": {"files": 3}}) == {"files": 3}
    answers = {"result": {"status": "ok", "data": {"application/json": {"files": 3}}}}
    assert ops.expression_result(op, answers) == {"files": 3}
    assert ops.expression_result(calls.remove("snap-1"), {}) == {}
    with pytest.raises(KernelError):
        ops.reply_result({"status": "ok", "result": [1]})
    with pytest.raises(KernelError, match="did not report"):
        ops.expression_result(op, {"result": {"status": "error", "evalue": "boom"}})


def call_reply(**content: object) -> dict[str, object]:
    return {"header": {"msg_type": ops.REPLY}, "parent_header": {"msg_id": "m"}, "content": content}


def test_the_collector_ends_a_call_on_its_reply_and_idle_and_keeps_its_error() -> None:
    c = OutputCollector("e", "m", limit_bytes=1000, next_seq=lambda: 0)
    assert c.feed(call_reply(status="ok", result={"x": 1})) == []
    assert not c.done
    c.feed({"header": {"msg_type": "status"}, "content": {"execution_state": "idle"}})
    assert c.done and c.reply_status == "ok" and c.call_reply["result"] == {"x": 1}
    assert c.output_bytes == 0  # bookkeeping, not output
    failed = OutputCollector("e", "m", limit_bytes=1000, next_seq=lambda: 0)
    tb = ["Traceback (most recent call last):\n", "FileNotFoundError: manifest.json\n"]
    failed.feed(call_reply(status="error", ename="FileNotFoundError", evalue="x", traceback=tb))
    assert failed.reply_status == "error" and failed.error is not None
    assert (
        failed.error.name == "FileNotFoundError" and "manifest.json" in failed.error.traceback_text
    )
