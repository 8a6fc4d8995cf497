"""A live session's state comes from the state machine, the operations act on its
verdicts (run, wake first, or refuse naming both states), and a crash recovery that
cannot start a sandbox gives up and drops the checkpoints (stand-in kernels and backend; the real
ones are exercised end to end in tests/gateway)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kernelhub.config import Limits, Settings
from kernelhub.errors import SandboxError, SessionClosedError, SessionStateError
from kernelhub.sandbox.base import Sandbox, SandboxBackend, SandboxSpec
from kernelhub.session.live import LiveSession, held
from kernelhub.session.operations import Operations
from kernelhub.session.recorder import Observer, Recorder
from kernelhub.session.recovery import SessionRecovery
from kernelhub.session.state import Operation, SessionState, Transition, Verdict
from kernelhub.store.records import Principal, StoredSession
from kernelhub.store.sqlite import SqliteStore


class StandInKernel:
    def __init__(self, *, alive: bool = True, paused: bool = False, running: bool = False):
        self.alive, self.paused = alive, paused
        self.running = object() if running else None
        self.user_busy = running
        self.queue_length = 0
        self.user_cells = int(running)


class Waker:
    """Continuity's wake, as the operations see it: the session comes back ready."""

    def __init__(self) -> None:
        self.woken: list[tuple[str, int]] = []

    async def wake(self, live: LiveSession, first_seq: int) -> None:
        self.woken.append((live.id, first_seq))
        live.kernel = StandInKernel()  # type: ignore[assignment]
        live.hibernation = None
        live.move(Transition.WOKE)


class NoRoomBackend(SandboxBackend):
    name = "no-room"

    def __init__(self) -> None:
        self.dropped: list[str] = []

    async def create(self, spec: SandboxSpec) -> Sandbox:
        raise SandboxError("no room for another sandbox")

    async def drop_state(self, session_id: str) -> None:
        self.dropped.append(session_id)

    async def reap_orphans(self) -> int:
        return 0


class DeadKernel:
    running = None
    last_seq = 7

    def __init__(self) -> None:
        self.closed_keeping_state: bool | None = None

    async def close(self, *, keep_state: bool = False) -> None:
        self.closed_keeping_state = keep_state


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


def _recovery(
    store: SqliteStore, tmp_path: Path, backend: SandboxBackend, settings: Settings | None = None
) -> SessionRecovery:
    recorder = Recorder(store, Observer(), coalesce_window=0.0)
    return SessionRecovery(
        settings or Settings(data_dir=tmp_path), backend, store, recorder,
        bind=lambda live, kernel: None,
    )  # fmt: skip


def _crashable(store: SqliteStore, phase: SessionState) -> LiveSession:
    live = _live(store, phase)
    live.recover_crashed, live.checkpoints = True, [(2, "ckpt-2-abcdef")]
    return live


async def test_a_recovery_that_cannot_start_a_sandbox_drops_the_checkpoints(
    store: SqliteStore, tmp_path: Path
) -> None:
    backend = NoRoomBackend()
    live, dead = _crashable(store, SessionState.READY), DeadKernel()
    given_up = await _recovery(store, tmp_path, backend).revive(live, dead, "out of memory")  # type: ignore[arg-type]
    assert given_up is not None and "no room" in given_up
    # The dead sandbox was closed keeping its state for the successor that never came;
    # the state (its checkpoints) goes now, and the session is recovering until the
    # caller declares it dead.
    assert dead.closed_keeping_state is True
    assert backend.dropped == ["sess01"]
    assert live.phase == SessionState.RECOVERING
    await live.fanout.close()


async def test_only_a_ready_session_can_crash_into_recovery(
    store: SqliteStore, tmp_path: Path
) -> None:
    backend = NoRoomBackend()
    live = _crashable(store, SessionState.HIBERNATED)
    recovery = _recovery(store, tmp_path, backend)
    with pytest.raises(
        SessionStateError, match="a hibernated session cannot take the transition 'crashed'"
    ):
        await recovery.revive(live, DeadKernel(), "gone")  # type: ignore[arg-type]
    assert backend.dropped == []
    await live.fanout.close()


async def test_a_dead_kernel_shows_recovering_while_recovery_would_revive_it(
    store: SqliteStore, tmp_path: Path
) -> None:
    # No checkpoint needed (an empty restart is a recovery too); a crash loop, or
    # recovery turned off, shows the session dead at once.
    live = _live(store, SessionState.READY, StandInKernel(alive=False))
    for limit, recover, state in [
        (5, True, SessionState.RECOVERING),
        (1, True, SessionState.DEAD),
        (5, False, SessionState.DEAD),
    ]:
        settings = Settings(data_dir=tmp_path)
        settings.gateway.crash_loop_limit, settings.gateway.recover_crashed = limit, recover
        live.revives = _recovery(store, tmp_path, NoRoomBackend(), settings).will_revive
        assert (live.checkpoints, live.state) == ([], state), (limit, recover)
    await live.fanout.close()


def test_session_table_sums_an_owners_reservations_through_its_index() -> None:
    """The reservation the storage guard checks on every cell: summed over the owner's
    sessions only (the table's index), equal to a scan of every session, through every
    way the table is written."""
    from types import SimpleNamespace

    from kernelhub.session.live import SessionTable, in_flight_bytes

    def live(owner: str, queued: int, running: bool, cap: int) -> Any:
        kernel = StandInKernel(running=running)
        kernel.queue_length = queued
        kernel.user_cells = queued + running
        return SimpleNamespace(
            stored=SimpleNamespace(owner=owner),
            kernel=kernel,
            limits=SimpleNamespace(output_bytes=cap),
        )

    table = SessionTable()
    plain: dict[str, Any] = {}
    rows = {
        "a1": live("ada", 2, True, 10),  # 3 cells
        "a2": live("ada", 0, False, 10),  # idle: nothing reserved
        "b1": live("bob", 1, False, 7),
        "a3": live("ada", 0, True, 5),
    }
    for sid, row in rows.items():
        table[sid] = plain[sid] = row
    assert in_flight_bytes(table, "ada") == in_flight_bytes(plain, "ada") == 35
    assert in_flight_bytes(table, "bob") == 7 and in_flight_bytes(table, "eve") == 0
    # Replaced under the same id (a recovery's new LiveSession): counted once.
    table["a1"] = live("ada", 0, True, 10)
    assert in_flight_bytes(table, "ada") == 15
    del table["a3"]
    assert table.pop("b1") is rows["b1"] and table.pop("b1", None) is None
    assert in_flight_bytes(table, "ada") == 10 and in_flight_bytes(table, "bob") == 0
    assert set(table.by_owner) == {"ada"} and set(table) == {"a1", "a2"}
    with pytest.raises(TypeError):
        table.update(plain)
    with pytest.raises(KeyError):
        del table["gone"]
