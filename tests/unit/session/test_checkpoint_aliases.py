"""The bookkeeping of checkpoints shared by cells that changed nothing (pure)."""

from __future__ import annotations

import itertools

from kernelhub.execution.collector import OutputCollector
from kernelhub.session.checkpoints import alias_for, next_count_after, unreferenced
from kernelhub.snapshot import calls


def test_a_cell_unchanged_since_the_last_checkpoint_shares_it() -> None:
    ckpts = [(1, "ckpt-1-a"), (3, "ckpt-3-b")]
    assert alias_for(ckpts, "ckpt-3-b", pending=False) == "ckpt-3-b"


def test_anything_else_captures_as_usual() -> None:
    ckpts = [(1, "ckpt-1-a"), (3, "ckpt-3-b")]
    assert alias_for(ckpts, None, pending=False) is None  # an old image, or a change
    assert alias_for(ckpts, "ckpt-1-a", pending=False) is None  # not the session's last
    assert alias_for(ckpts, "ckpt-3-b", pending=True) is None  # a capture is due anyway
    assert alias_for([], "ckpt-3-b", pending=False) is None  # e.g. after a restart


def test_directories_go_only_when_no_entry_names_them() -> None:
    dropped = [(1, "ckpt-1-a"), (2, "ckpt-1-a"), (3, "ckpt-3-b")]
    assert unreferenced(dropped, [(4, "ckpt-3-b"), (5, "ckpt-5-c")]) == ["ckpt-1-a"]
    assert unreferenced(dropped, []) == ["ckpt-1-a", "ckpt-3-b"]


def test_an_alias_restores_the_count_of_the_cell_after_it() -> None:
    ckpts = [(1, "ckpt-1-a"), (2, "ckpt-1-a"), (3, "ckpt-1-a"), (4, "ckpt-4-b")]
    assert next_count_after(ckpts, 1, "ckpt-1-a") is None  # its own capture's count
    assert next_count_after(ckpts, 3, "ckpt-1-a") == 4
    assert next_count_after(ckpts, 4, "ckpt-4-b") is None


def test_restore_passes_the_count_only_when_asked() -> None:
    assert "execution_count" not in calls.restore("ckpt-1-a").code  # what old images accept
    assert "execution_count=4)" in calls.restore("ckpt-1-a", 4).code


def test_the_collector_reads_the_hint_from_the_reply_metadata() -> None:
    def collector() -> OutputCollector:
        counter = itertools.count(1)
        return OutputCollector(
            "e1", "m", limit_bytes=1000, limit_events=100, tail_bytes=0,
            next_seq=lambda: next(counter),
        )  # fmt: skip

    def reply(metadata: object) -> dict[str, object]:
        return {
            "header": {"msg_type": "execute_reply"},
            "parent_header": {"msg_id": "m"},
            "metadata": metadata,
            "content": {"status": "ok", "execution_count": 2},
        }

    c = collector()
    c.feed(reply({"kernelhub_unchanged_since": "ckpt-1-a"}))
    assert c.unchanged_since == "ckpt-1-a"
    for metadata in ({}, None, {"kernelhub_unchanged_since": 3}):
        c = collector()
        c.feed(reply(metadata))
        assert c.unchanged_since is None
