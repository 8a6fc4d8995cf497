"""Crash recovery's bookkeeping, with a backend that cannot start a sandbox (the real
recovery is exercised end to end in tests/gateway/test_gateway.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kernelhub.config import Limits, Settings, StorageSettings
from kernelhub.errors import SandboxError, SessionStateError
from kernelhub.sandbox.base import Sandbox, SandboxBackend, SandboxSpec
from kernelhub.session.continuity import Continuity
from kernelhub.session.live import LiveSession
from kernelhub.session.recorder import Observer, Recorder
from kernelhub.session.state import SessionState
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store.quota import StorageGuard
from kernelhub.store.sqlite import SqliteStore, StoredSession


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


def _live(recorder: Recorder, phase: SessionState) -> LiveSession:
    stored = StoredSession(
        id="sess01", owner="alice", backend="no-room", state=phase.value,
        created_at=datetime.now(UTC), limits={}, metadata={}, reason=None, deleted_at=None,
    )  # fmt: skip
    live = LiveSession(stored=stored, limits=Limits(), fanout=recorder.fanout("sess01"))
    live.phase, live.recover_crashed = phase, True
    live.checkpoints = [(2, "ckpt-2-abcdef")]
    return live


async def test_a_recovery_that_cannot_start_a_sandbox_drops_the_checkpoints(
    store: SqliteStore, tmp_path: Path
) -> None:
    backend = NoRoomBackend()
    recorder = Recorder(store, Observer(), coalesce_window=0.0)
    settings = Settings(data_dir=tmp_path)
    guard = StorageGuard(StorageSettings(min_free_bytes=0), store.ledger, tmp_path)
    spawned: list[Any] = []
    continuity = Continuity(
        settings, backend, store, recorder, BlobStore(tmp_path), guard,
        bind=lambda live, kernel: None, spawn=spawned.append,
    )  # fmt: skip
    live = _live(recorder, SessionState.READY)
    dead = DeadKernel()
    with pytest.raises(SandboxError, match="no room"):
        await continuity.recover(live, dead, "out of memory")  # type: ignore[arg-type]
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
    recorder = Recorder(store, Observer(), coalesce_window=0.0)
    guard = StorageGuard(StorageSettings(min_free_bytes=0), store.ledger, tmp_path)
    continuity = Continuity(
        Settings(data_dir=tmp_path), backend, store, recorder, BlobStore(tmp_path), guard,
        bind=lambda live, kernel: None, spawn=lambda coro: None,
    )  # fmt: skip
    live = _live(recorder, SessionState.HIBERNATED)
    with pytest.raises(
        SessionStateError, match="a hibernated session cannot take the transition 'crashed'"
    ):
        await continuity.recover(live, DeadKernel(), "gone")  # type: ignore[arg-type]
    assert backend.dropped == []
    await live.fanout.close()
