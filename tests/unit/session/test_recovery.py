"""The crash-recovery decision and its notice (pure)."""

from __future__ import annotations

from kernelhub.session.recovery import describe, plan


def decide(**kw: object) -> str:
    args: dict[str, object] = {
        "enabled": True,
        "checkpoints": 1,
        "deaths": [100.0],
        "now": 100.0,
        "limit": 3,
        "window": 60.0,
    }
    args.update(kw)
    return plan(**args).kind  # type: ignore[arg-type]


def test_a_death_with_a_checkpoint_restores_it_and_without_one_restarts_empty() -> None:
    assert decide() == "checkpoint"
    assert decide(checkpoints=0) == "empty"


def test_only_a_crash_loop_or_the_operator_ends_a_session() -> None:
    assert decide(deaths=[50.0, 90.0, 100.0]) == "dead"
    # Deaths older than the window do not count.
    assert decide(deaths=[10.0, 20.0, 100.0]) == "checkpoint"
    off = plan(enabled=False, checkpoints=1, deaths=[1.0], now=1.0, limit=3, window=60.0)
    assert off.kind == "dead" and "KERNELHUB_GATEWAY__RECOVER_CRASHED" in off.why
    loop = plan(enabled=True, checkpoints=0, deaths=[1.0, 2.0], now=2.0, limit=2, window=9.0)
    assert "2 times within 9 s" in loop.why and "CRASH_LOOP_LIMIT" in loop.why


def test_the_notice_names_what_came_back_and_what_was_lost() -> None:
    text = describe("out of memory: limit 512 MiB", 3.14, 4, ["e5", "e6"], {"g": "no"}, None)
    assert "out of memory" in text and "checkpoint after cell 4" in text
    assert "e5, e6" in text and "'g': 'no'" in text and "3.14 s" in text
    empty = describe("signal 11 (SIGSEGV)", 1.0, None, ["e1"], {}, "the session had no checkpoint")
    assert "restarted empty" in empty and "no checkpoint" in empty
    assert "every variable, import and file of /workspace is gone" in empty and "e1" in empty


def test_the_notice_of_a_lost_node_names_it_and_where_the_session_is_now() -> None:
    text = describe("", 1.234, 2, ["e3"], {}, None, cause="node a was lost", where="on node b")
    assert text.startswith("node a was lost; recovered in 1.23 s on node b from the checkpoint")
    assert "after cell 2" in text and "e3" in text and "kernel died" not in text
