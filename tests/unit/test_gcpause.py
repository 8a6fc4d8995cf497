"""gcpause: counted holds of CPython's collector, bounded in time, never left on or off."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from kernelhub import gcpause


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    assert gcpause.holds() == 0 and gc.isenabled()
    yield
    assert gcpause.holds() == 0, "a test leaked a hold"
    assert gc.isenabled()


def test_holds_are_counted_and_the_last_release_turns_it_back_on() -> None:
    gcpause.hold()
    with gcpause.held():
        assert not gc.isenabled()
    assert not gc.isenabled(), "one hold is still taken"
    gcpause.release()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        gcpause.release()


def test_a_collector_someone_else_turned_off_stays_off() -> None:
    gc.disable()
    try:
        with gcpause.held():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_long_hold_collects_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[int] = []
    monkeypatch.setattr(gcpause.gc, "collect", lambda *a: collected.append(1) or 0)
    monkeypatch.setattr(gcpause, "MAX_HOLD_SECONDS", 0.0)  # every later hold is "late"
    with gcpause.held():
        with gcpause.held():
            pass
        with gcpause.held():
            pass
    assert len(collected) == 2


async def test_a_hold_for_this_turn_ends_after_the_current_callback() -> None:
    gcpause.hold_this_turn()
    assert not gc.isenabled()
    await asyncio.sleep(0)
    assert gc.isenabled()


async def test_the_fanout_holds_it_while_a_big_event_is_sliced(tmp_path: object) -> None:
    from pathlib import Path

    from kernelhub import jsonslices
    from kernelhub.models import DisplayEvent
    from kernelhub.session.fanout import SessionFanout
    from kernelhub.store.sqlite import SqliteStore

    store = await SqliteStore.open(Path(str(tmp_path)) / "kh.sqlite3")
    try:
        fanout = SessionFanout("s1", store)
        data = {"application/json": [{"a": i, "b": [1, 2]} for i in range(30_000)]}
        fanout.publish(DisplayEvent(execution_id="e1", seq=1, data=data))
        assert not gc.isenabled()
        await fanout.flush()
        await asyncio.sleep(0)
        assert gc.isenabled()
        ((_, body),) = await store.events_since("s1", 0)
        assert jsonslices.run(jsonslices.loads(body.encode()))["data"] == data
        # Cancelled before it ever ran, the slicing task still lets go.
        fanout.publish(DisplayEvent(execution_id="e1", seq=2, data=data))
        assert not gc.isenabled()
        await fanout.close()
        await asyncio.sleep(0)
        assert gc.isenabled()
    finally:
        await store.close()


def test_one_long_hold_is_bounded_by_its_holders_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[int] = []
    monkeypatch.setattr(gcpause.gc, "collect", lambda *a: collected.append(1) or 0)
    gcpause.keep_bounded()  # no hold: nothing to bound
    with gcpause.held():
        gcpause.keep_bounded()  # within the interval
        assert collected == []
        monkeypatch.setattr(gcpause, "MAX_HOLD_SECONDS", 0.0)
        gcpause.keep_bounded()
    assert collected == [1]
