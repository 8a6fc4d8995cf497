"""A live session's state comes from the state machine, and the operations act on its
verdicts: run, wake first, or refuse naming both states (stand-in kernels; the real ones
are exercised end to end in tests/gateway)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kernelhub.config import Limits, Settings
from kernelhub.errors import SessionClosedError, SessionStateError
from kernelhub.session.live import LiveSession, held
from kernelhub.session.operations import Operations
from kernelhub.session.recorder import Observer, Recorder
from kernelhub.session.state import Operation, SessionState, Transition, Verdict
from kernelhub.store.sqlite import Principal, SqliteStore, StoredSession


class StandInKernel:
    def __init__(self, *, alive: bool = True, paused: bool = False, running: bool = False):
        self.alive, self.paused = alive, paused
        self.running = object() if running else None
        self.queue_length = 0


class Waker:
    """Continuity's wake, as the operations see it: the session comes back ready."""

    def __init__(self) -> None:
        self.woken: list[tuple[str, int]] = []

    async def wake(self, live: LiveSession, first_seq: int) -> None:
        self.woken.append((live.id, first_seq))
        live.kernel = StandInKernel()  # type: ignore[assignment]
        live.hibernation = None
        live.move(Transition.WOKE)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = await SqliteStore.open(tmp_path / "store.sqlite3")
    yield opened
    await opened.close()


def _live(store: SqliteStore, phase: SessionState, kernel: Any = None) -> LiveSession:
    recorder = Recorder(store, Observer(), coalesce_window=0.0)
    stored = StoredSession(
        id="sess01", owner="alice", backend="docker", state=phase.value,
        created_at=datetime.now(UTC), limits={}, metadata={}, reason=None, deleted_at=None,
    )  # fmt: skip
    live = LiveSession(stored=stored, limits=Limits(), fanout=recorder.fanout("sess01"))
    live.phase, live.kernel = phase, kernel
    return live


async def test_the_state_is_the_machines_view_of_the_phase_and_the_kernel(
    store: SqliteStore,
) -> None:
    live = _live(store, SessionState.READY, StandInKernel(running=True))
    assert live.state == SessionState.BUSY and live.allows(Operation.EXECUTE) is Verdict.RUN
    live.kernel = StandInKernel(paused=True)  # type: ignore[assignment]
    assert live.state == SessionState.PAUSED and live.ready_kernel(Operation.CANCEL) is live.kernel
    with pytest.raises(SessionStateError, match="is paused: cannot execute"):
        live.ready_kernel()
    live.kernel = StandInKernel(alive=False)  # type: ignore[assignment]
    assert live.state == SessionState.DEAD  # not recoverable: no checkpoints
    live.recover_crashed, live.checkpoints = True, [(1, "ckpt-1")]
    assert live.state == SessionState.RECOVERING and live.ready_kernel() is None  # waits
    assert live.move(Transition.CRASHED) == SessionState.RECOVERING
    with pytest.raises(
        SessionStateError, match="a recovering session cannot take the transition 'hibernate'"
    ):
        live.move(Transition.HIBERNATE)
    await live.fanout.close()


async def test_only_the_owner_or_an_admin_holds_a_session(store: SqliteStore) -> None:
    live = _live(store, SessionState.READY, StandInKernel())
    sessions = {live.id: live}
    assert held(sessions, Principal(name="alice"), live.id) is live
    assert held(sessions, Principal(name="bob"), live.id) is None
    assert held(sessions, Principal(name="root", admin=True), live.id) is live
    assert held(sessions, Principal(name="alice"), "other") is None
    await live.fanout.close()


async def test_work_on_a_hibernated_session_wakes_it_and_refusals_name_both_states(
    store: SqliteStore, tmp_path: Path
) -> None:
    live = _live(store, SessionState.HIBERNATED)
    live.hibernation = "snap01"
    waker = Waker()

    async def get(principal: Principal, session_id: str) -> LiveSession:
        return live

    ops = Operations(
        Settings(data_dir=tmp_path), store, Recorder(store, Observer(), coalesce_window=0.0),
        waker, None, {live.id: live}, get=get, info=None,  # type: ignore[arg-type]
    )  # fmt: skip
    kernel = await ops.kernel_for(live, Operation.FILES)
    assert waker.woken == [("sess01", 0)] and kernel is live.kernel
    assert live.state == SessionState.READY and live.last_active > 0
    # Ready: nothing to resume, and interrupting needs no wait either way.
    with pytest.raises(SessionStateError) as refused:
        await ops.kernel_for(live, Operation.RESUME)
    assert (refused.value.state, refused.value.operation) == ("ready", "resume")
    assert ops.kernel_now(live, Operation.INTERRUPT) is kernel
    live.move(Transition.DIED)
    with pytest.raises(SessionClosedError, match="has ended"):
        ops.kernel_now(live, Operation.INPUT)
    await live.fanout.close()
