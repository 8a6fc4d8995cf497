"""Node loss and draining (issue #24 item 5) with real Docker sandboxes: several session
managers in one test, each a "node" with its own data and run directories and sandbox
instance, sharing the run's private PostgreSQL server and one snapshot storage (the
blob directory and its MAC key, until object storage is the seam). Heartbeats are the
test's own (the node agent's come with ``kernelhub node``): stopping one is a lost node."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import docker
import pytest

from kernelhub.cluster.models import NodeInfo
from kernelhub.config import Settings, load_settings
from kernelhub.models import ExecutionStatus, NoticeEvent, StreamEvent
from kernelhub.sandbox.backends import make_backend
from kernelhub.session.manager import SessionManager
from kernelhub.session.state import SessionState
from kernelhub.store import open_store
from kernelhub.store.records import Principal
from kernelhub.wire import ExecutionCreate, SessionCreate
from tests.conftest import RUN_INSTANCE, UNIT, eventually
from tests.postgres import PostgresCluster

pytestmark = [pytest.mark.docker, pytest.mark.postgres]

ALICE = Principal(name="alice")
LEASE = 1.5 * UNIT


class Node:
    """One node: a session manager on the shared store, beating while ``beating``."""

    def __init__(self, name: str, root: Path, url: str, shared: Path, **cluster: Any) -> None:
        self.name = name
        self.instance = f"{RUN_INSTANCE}-f{uuid.uuid4().hex[:4]}{name}"
        data = root / name
        data.mkdir(parents=True)
        # One snapshot storage: every node's blob directory and MAC key are the same.
        (data / "snapshots").symlink_to(shared / "snapshots", target_is_directory=True)
        (data / "snapshot.key").symlink_to(shared / "snapshot.key")
        run = Path("/tmp/khrun") if os.geteuid() else Path("/run/kernelhub-test")
        self.settings: Settings = load_settings(
            data_dir=data, run_dir=run, backend="docker",
            store={"url": url, "node": name},
            pool={"size": 0},
            cluster={"address": f"https://{name}.test:8766", "lease_ttl": LEASE,
                     "heartbeat_interval": 0.2 * UNIT, "checkpoint_export_interval": 0,
                     **cluster},
        )  # fmt: skip
        self.beating = True
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> SessionManager:
        self.store = await open_store(self.settings)
        self.backend = make_backend(self.settings, instance=self.instance, gateway_id=self.name)
        await self.beat()  # alive before its first sweep
        self.manager = SessionManager(self.settings, self.backend, self.store)
        await self.manager.start()
        self._tasks.append(asyncio.create_task(self._beat_forever()))
        self._tasks.append(asyncio.create_task(self.manager.failover.run()))  # a node task
        return self.manager

    async def beat(self) -> None:
        now = datetime.now(UTC)
        sessions = sum(1 for s in self.manager.sessions.values() if s.kernel) if self._tasks else 0
        await self.store.upsert_node(
            NodeInfo(id=self.name, address=f"https://{self.name}.test:8766",
                     started_at=now, heartbeat_at=now,
                     lease_expires_at=now + timedelta(seconds=LEASE), sessions=sessions)
        )  # fmt: skip

    async def _beat_forever(self) -> None:
        while True:
            if self.beating:
                await self.beat()
            await asyncio.sleep(0.2 * UNIT)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.manager.close()
        await self.backend.close()
        await self.store.close()

    def containers(self, session_id: str) -> list[Any]:
        client = docker.from_env(timeout=30)
        try:
            return list(
                client.containers.list(
                    filters={"label": [f"org.kernelhub.instance={self.instance}",
                                       f"org.kernelhub.session={session_id}"]}
                )
            )  # fmt: skip
        finally:
            client.close()


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    root = tmp_path / "shared"
    (root / "snapshots").mkdir(parents=True, mode=0o700)
    (root / "snapshot.key").write_bytes(os.urandom(32))
    return root


@pytest.fixture
async def cluster(
    postgres_cluster: PostgresCluster, tmp_path: Path, shared: Path
) -> AsyncIterator[Callable[..., Any]]:
    """Factory: ``await cluster("a", "b")`` → started nodes on one fresh store."""
    url = postgres_cluster.fresh_url()
    nodes: list[Node] = []

    async def make(*names: str, **opts: Any) -> list[Node]:
        made = [Node(n, tmp_path / "nodes", url, shared, **opts) for n in names]
        for node in made:
            await node.start()
            nodes.append(node)
        return made

    yield make
    for node in nodes:
        with contextlib.suppress(Exception):
            await node.manager.stop_all(Principal(name="admin", admin=True))
        await node.close()


async def run(manager: SessionManager, sid: str, code: str) -> tuple[ExecutionStatus, str]:
    row, handle, _ = await manager.submit(ALICE, sid, ExecutionCreate(code=code))
    assert handle is not None
    record = (await asyncio.wait_for(handle.wait(), 60 * UNIT)).record
    _, events = await manager.execution(ALICE, row.id)
    out = "".join(e.text for e in events or [] if isinstance(e, StreamEvent))
    return record.status, out


async def until(what: str, timeout: float, check: Callable[[], Awaitable[Any]]) -> Any:
    """Poll ``check`` until it returns something truthy (returned), failing after
    ``timeout`` × UNIT seconds."""
    deadline = asyncio.get_running_loop().time() + timeout * UNIT
    while not (found := await check()):
        assert asyncio.get_running_loop().time() < deadline, f"{what} within {timeout * UNIT:g} s"
        await asyncio.sleep(0.05)
    return found


async def exported(node: Node, sid: str, after_cell: int) -> None:
    """Wait until the session's checkpoint after ``after_cell`` is in shared storage."""

    async def done() -> bool:
        snap = await node.manager.failover.adoption.last_checkpoint(ALICE.name, sid)
        # The kernel's count is the next cell's number.
        return snap is not None and (snap.metadata.get("execution_count") or 0) > after_cell

    await until("a checkpoint exported", 60, done)


async def test_a_lost_nodes_session_comes_back_on_a_survivor_with_its_state(
    cluster: Callable[..., Any],
) -> None:
    a, b = await cluster("a", "b")
    sid = (await a.manager.create(ALICE, SessionCreate())).id
    assert (await run(a.manager, sid, "x = 41"))[0] == ExecutionStatus.COMPLETED
    assert (await run(a.manager, sid, "x += 1\nprint('x is', x)"))[1] == "x is 42\n"
    await exported(a, sid, 2)
    # A cell running when the node is lost: its effects (y) are lost with it.
    code = "y = 1\nprint('started', flush=True)\nimport time; time.sleep(600)"
    long_row, handle, _ = await a.manager.submit(ALICE, sid, ExecutionCreate(code=code))
    assert handle is not None
    await eventually(lambda: handle.status == ExecutionStatus.RUNNING, 30)
    a.beating = False  # node a is lost: its lease runs out, b's sweep adopts its session

    await eventually(lambda: sid in b.manager.sessions, 30)
    status, out = await run(b.manager, sid, "print(x, 'y' in dir())")
    assert (status, out) == (ExecutionStatus.COMPLETED, "42 False\n")

    info = await b.manager.info(ALICE, sid)
    assert info.recovery is not None and info.recovery.lost_node == "a"
    assert info.recovery.checkpoint_after_cell == 2
    assert info.recovery.lost == [long_row.id]
    assert info.recovery.message.startswith("node a was lost; recovered in ")
    assert "on node b, in a fresh sandbox from the checkpoint after cell 2" in info.recovery.message
    row = await b.store.get_session(sid)
    assert row is not None and row.node == "b"
    lost_cell = await b.store.get_execution(long_row.id)
    assert lost_cell is not None and lost_cell.status == ExecutionStatus.FAILED
    assert lost_cell.record is not None and "node a was lost" in (lost_cell.record.reason or "")
    # The stream replays gap-free across the move: numbered on from the store's last seq.
    await b.manager.live(ALICE, sid)
    events = await b.store.session_events_of(sid)
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)), seqs
    notices = [e for e in events if isinstance(e, NoticeEvent) and e.kind == "recovered"]
    assert len(notices) == 1 and long_row.id in notices[0].message
    # Fencing: a, still running, finds the row naming b and stops its own sandbox.
    await eventually(lambda: sid not in a.manager.sessions, 30)
    assert a.containers(sid) == []
    assert len(b.containers(sid)) == 1


async def test_two_sweepers_racing_take_each_session_once(cluster: Callable[..., Any]) -> None:
    # Sweeps by hand (one an hour on their own), with no grace: each plans to take all.
    a, b, c = await cluster("a", "b", "c", heartbeat_interval=3600)
    sids = [(await a.manager.create(ALICE, SessionCreate())).id for _ in range(2)]
    for sid in sids:
        await run(a.manager, sid, f"z = {sid!r}")
        await exported(a, sid, 1)
    a.beating = False

    async def lost() -> bool:
        row = await b.store.get_node("a")
        return row is not None and not row.alive(datetime.now(UTC))

    await until("a's lease ran out", 30, lost)
    for node in (b, c):
        node.manager.failover.sweeper.grace = 0
    took_b, took_c = await asyncio.gather(
        b.manager.failover.sweeper.tick(), c.manager.failover.sweeper.tick()
    )
    taken = [t.session_id for t in took_b + took_c]
    assert sorted(taken) == sorted(sids)
    for sid in sids:
        holder = b if sid in b.manager.sessions else c
        assert sid not in (c if holder is b else b).manager.sessions
        assert (await run(holder.manager, sid, "print(z)"))[1] == f"{sid}\n"


async def test_a_drained_nodes_sessions_hibernate_and_wake_on_another(
    cluster: Callable[..., Any],
) -> None:
    a, b = await cluster("a", "b")
    sid = (await a.manager.create(ALICE, SessionCreate())).id
    await run(a.manager, sid, "import math\nv = [math.pi] * 3")
    assert await a.store.set_draining("a", True)

    async def released() -> bool:
        row = await a.store.get_session(sid)
        return row is not None and row.node is None and row.state == "hibernated"

    await until("the drain moved it", 60, released)
    assert sid not in a.manager.sessions and a.containers(sid) == []
    # Its next call, placed on b, wakes it there with its state.
    status, out = await run(b.manager, sid, "print(round(sum(v), 4))")
    assert (status, out) == (ExecutionStatus.COMPLETED, "9.4248\n")
    row = await b.store.get_session(sid)
    assert row is not None and row.node == "b" and len(b.containers(sid)) == 1


async def test_a_node_back_from_the_dead_runs_none_of_its_old_sessions(
    cluster: Callable[..., Any],
) -> None:
    # Sweeps by hand; a exports nothing, so b can only start the session empty.
    (a,) = await cluster("a", heartbeat_interval=3600, checkpoint_export_interval=None)
    (b,) = await cluster("b", heartbeat_interval=3600)
    sid = (await a.manager.create(ALICE, SessionCreate())).id
    await run(a.manager, sid, "w = 1")
    a.beating = False  # a hangs: no heartbeat, no sweep, its sandbox still running
    b.manager.failover.sweeper.grace = 0
    await until("b adopted the session", 30, b.manager.failover.sweeper.tick)
    assert len(a.containers(sid)) == 1  # both run it, for now: a has not noticed
    info = await b.manager.info(ALICE, sid)
    assert info.recovery is not None and info.recovery.checkpoint_after_cell is None
    message = info.recovery.message
    assert message.startswith("node a was lost; restarted empty in ") and "on node b" in message
    assert "(the session had no exported checkpoint)" in message
    assert (await run(b.manager, sid, "print('w' in dir())"))[1] == "False\n"
    # a's process ends and starts again (its sandboxes outlived it): before it serves,
    # the session it lost is not its own, and its sandbox is gone.
    await a.close()
    await a.start()
    assert sid not in a.manager.sessions and a.containers(sid) == []
    assert (await run(b.manager, sid, "print('still on b')"))[1] == "still on b\n"


async def test_hibernated_on_one_node_wakes_on_another(cluster: Callable[..., Any]) -> None:
    a, b = await cluster("a", "b")
    sid = (await a.manager.create(ALICE, SessionCreate())).id
    await run(a.manager, sid, "word = 'hibernated on a'")
    await exported(a, sid, 1)  # its export done: idle, it hibernates at once
    live = a.manager.sessions[sid]
    await a.manager.hibernate(live)
    assert live.phase == SessionState.HIBERNATED

    async def released() -> bool:
        row = await b.store.get_session(sid)
        return row is not None and row.node is None

    await until("a gave up its hibernated session", 30, released)
    assert sid not in a.manager.sessions and a.containers(sid) == []
    assert (await run(b.manager, sid, "print(word)"))[1] == "hibernated on a\n"
    row = await b.store.get_session(sid)
    assert row is not None and row.node == "b"


async def test_a_released_session_deleted_on_another_node_takes_its_snapshot_along(
    cluster: Callable[..., Any], shared: Path
) -> None:
    a, b = await cluster("a", "b")
    sid = (await a.manager.create(ALICE, SessionCreate())).id
    await run(a.manager, sid, "big = 'x' * 1000")
    await exported(a, sid, 1)
    await a.manager.hibernate(a.manager.sessions[sid])

    async def released() -> str | None:
        row = await b.store.get_session(sid)
        return row.hibernation if row is not None and row.node is None else None

    snapshot = await until("a gave up its hibernated session", 30, released)
    assert (shared / "snapshots" / f"{snapshot}.blob").is_file()
    await b.manager.delete(ALICE, sid)
    assert await b.store.get_snapshot(snapshot) is None
    assert not (shared / "snapshots" / f"{snapshot}.blob").exists()
    row = await b.store.get_session(sid)
    assert row is not None and row.deleted_at is not None


async def test_a_tampered_export_is_refused_and_the_session_starts_empty(
    cluster: Callable[..., Any], shared: Path
) -> None:
    a, b = await cluster("a", "b")
    sid = (await a.manager.create(ALICE, SessionCreate())).id
    await run(a.manager, sid, "secret = 7")
    await exported(a, sid, 1)
    snap = await a.manager.failover.adoption.last_checkpoint(ALICE.name, sid)
    assert snap is not None
    with open(shared / "snapshots" / f"{snap.id}.blob", "ab") as blob:
        blob.write(b"\0")  # edited in the shared storage: its MAC no longer matches
    a.beating = False
    await eventually(lambda: sid in b.manager.sessions, 30)
    assert (await run(b.manager, sid, "print('secret' in dir())"))[1] == "False\n"
    info = await b.manager.info(ALICE, sid)
    assert info.recovery is not None and info.recovery.checkpoint_after_cell is None
    assert f"its checkpoint {snap.id} would not load" in info.recovery.message
