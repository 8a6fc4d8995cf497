"""The running cell's spool: written in the sandbox (``kernelhub_kernel.spool``), read by
a gateway that re-adopts the session (``kernelhub.session.salvage``). Pure file I/O."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from kernelhub.execution.collector import OutputCollector
from kernelhub.models import StreamEvent
from kernelhub.session.salvage import code_digest, parse, read_from

SPOOL_PY = Path(__file__).resolve().parents[3] / "kernel-image" / "kernelhub_kernel" / "spool.py"


def kernel_spool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kernel_spool", SPOOL_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def msg(msg_type: str, parent: str, **content: Any) -> dict[str, Any]:
    return {
        "header": {"msg_type": msg_type, "msg_id": f"{msg_type}-{parent}-{len(content)}"},
        "parent_header": {"msg_id": parent, "msg_type": "execute_request"},
        "metadata": {},
        "content": content,
    }


def cell(spool: Any, parent: str, code: str, lines: list[str]) -> None:
    spool.record(msg("status", parent, execution_state="busy"))
    spool.record(msg("execute_input", parent, code=code, execution_count=3))
    for text in lines:
        spool.record(msg("stream", parent, name="stdout", text=text))
    spool.record(msg("execute_reply", parent, status="ok", execution_count=3))
    spool.record(msg("status", parent, execution_state="idle"))


def test_the_spool_keeps_the_latest_user_cell_and_the_collector_replays_it(tmp_path: Path) -> None:
    spool = kernel_spool().Spool(str(tmp_path / "iopub.spool"), 1 << 20)
    cell(spool, "old", "print(0)", ["0\n"])
    # A silent execute (the host's own call: no execute_input) does not touch it.
    spool.record(msg("status", "silent", execution_state="busy"))
    spool.record(msg("execute_reply", "silent", status="ok"))
    cell(spool, "new", "for i in range(3): print(i)", ["0\n1\n", "2\n"])
    lines, used = parse((tmp_path / "iopub.spool").read_bytes())
    assert used == (tmp_path / "iopub.spool").stat().st_size
    assert lines.cell == "new" and lines.code_sha256 == code_digest("for i in range(3): print(i)")
    assert lines.replied is not None and lines.started is not None
    kinds = [m["header"]["msg_type"] for m in lines.messages]
    assert kinds == ["status", "execute_input", "stream", "stream", "execute_reply", "status"]
    collector = OutputCollector("e", "new", limit_bytes=1 << 20, next_seq=lambda: 0)
    events = [e for m in lines.messages for e in collector.feed(m)]
    assert "".join(e.text for e in events if isinstance(e, StreamEvent)) == "0\n1\n2\n"
    assert collector.done and collector.reply_status == "ok" and collector.execution_count == 3


def test_past_its_bound_the_spool_keeps_the_outcome_and_counts_the_rest(tmp_path: Path) -> None:
    spool = kernel_spool().Spool(str(tmp_path / "iopub.spool"), 2000)
    cell(spool, "c", "flood()", ["x" * 300 + "\n"] * 20)
    lines, _ = parse((tmp_path / "iopub.spool").read_bytes())
    kinds = [m["header"]["msg_type"] for m in lines.messages]
    assert kinds[-2:] == ["execute_reply", "status"] and 0 < kinds.count("stream") < 20
    assert lines.dropped_messages == 20 - kinds.count("stream")
    assert lines.dropped_bytes > 300 * lines.dropped_messages


def test_a_partial_last_line_waits_and_bad_lines_are_skipped() -> None:
    head = json.dumps({"cell": "c", "code_sha256": "d", "t": 1.0}).encode() + b"\n"
    data = head + b"not json\n" + b'["a list"]\n' + b'{"m": {"header": {"msg_ty'
    lines, used = parse(data)
    assert lines.cell == "c" and lines.malformed == 2 and used == data.rfind(b"\n") + 1


def test_the_gateway_reads_only_a_regular_file(tmp_path: Path) -> None:
    target = tmp_path / "host-secret"
    target.write_text("secret\n")
    link = tmp_path / "iopub.spool"
    link.symlink_to(target)
    assert read_from(link, 0, 1000) is None
    link.unlink()
    os.mkfifo(link)  # would block a plain open for reading forever
    assert read_from(link, 0, 1000) is None
    link.unlink()
    link.write_bytes(b"0123456789")
    assert read_from(link, 2, 5) == b"23456"
    assert read_from(tmp_path / "missing", 0, 10) is None
