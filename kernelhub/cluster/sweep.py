"""The node-loss sweep (issue #24): every node agent, every heartbeat interval, looks for
nodes whose lease ran out and takes over their sessions.

:func:`plan` is the decision, pure: given the nodes' rows, the sessions of lost nodes and
the time, which of them this node restores (spread over the live nodes, least loaded
first, so one survivor does not take them all) and which only lose their node (hibernated
ones: they wake wherever their next call is placed). Every node computes the same spread
from the same rows; the store's compare-and-set (``claim_session``) makes each session
move once even when two nodes disagree, and a session its assignee has not taken within
``grace`` seconds of its node's loss is up for any live node.

:class:`Sweeper` is the loop: fence (stop running what the store no longer gives this
node), drain (when an operator asked), give up hibernated sessions, then sweep.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from kernelhub.cluster.models import NodeInfo
from kernelhub.errors import KernelhubError
from kernelhub.session.state import SessionState
from kernelhub.store.base import Store
from kernelhub.store.records import StoredSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Take:
    """One session of a lost node for this node: ``adopt`` (restore it here from its
    last checkpoint) or ``release`` (a hibernated one: clear its node, it wakes anywhere)."""

    session_id: str
    from_node: str | None
    kind: Literal["adopt", "release"]


def plan(
    nodes: Sequence[NodeInfo],
    orphans: Iterable[StoredSession],
    me: str,
    now: datetime,
    *,
    grace: float,
) -> list[Take]:
    """``orphans``: sessions whose node may be lost (the node's rows decide; a session
    naming a node with no row at all counts as lost once its own lease ran out)."""
    targets = sorted((n for n in nodes if n.alive(now) and not n.draining), key=lambda n: n.id)
    if me not in {n.id for n in targets}:
        return []  # lost, draining, or not beating yet: this node takes nothing
    rows = {n.id: n for n in nodes}
    load = {n.id: n.sessions for n in targets}
    takes: list[Take] = []
    seen: set[str] = set()
    for s in sorted(orphans, key=lambda s: (s.created_at, s.id)):
        node = rows.get(s.node) if s.node is not None else None
        if s.id in seen or s.node is None or (node is not None and node.alive(now)):
            continue
        seen.add(s.id)
        if s.state == SessionState.HIBERNATED.value:
            takes.append(Take(s.id, s.node, "release"))
            continue
        if s.state in (SessionState.DEAD.value, SessionState.DELETED.value):
            continue
        since = node.lease_expires_at if node is not None else s.lease_expires_at
        if since is None or since > now:
            continue  # an unknown node whose session lease still holds
        target = min(targets, key=lambda n: (load[n.id], n.id))
        load[target.id] += 1
        if target.id == me or (now - since).total_seconds() >= grace:
            takes.append(Take(s.id, s.node, "adopt"))
    return takes


class Sweeper:
    """The loop each node agent runs (see the module). ``fence``, ``drain``, ``adopt``
    and ``release`` are the node's (:class:`~kernelhub.cluster.adopt.Adoption`);
    ``release`` and ``adopt`` return whether this node won the session."""

    def __init__(
        self,
        store: Store,
        me: str,
        *,
        interval: float,
        grace: float,
        concurrency: int,
        fence: Callable[[], Awaitable[list[str]]],
        drain: Callable[[], Awaitable[int]],
        release_hibernated: Callable[[], Awaitable[int]],
        adopt: Callable[[StoredSession], Awaitable[bool]],
        release: Callable[[str, str | None], Awaitable[bool]],
    ) -> None:
        self.store = store
        self.me = me
        self.interval = interval
        self.grace = grace
        self._slots = asyncio.Semaphore(concurrency)
        self._fence, self._drain, self._release_hibernated = fence, drain, release_hibernated
        self._adopt, self._release = adopt, release

    async def run(self) -> None:
        task = asyncio.current_task()
        while True:
            try:
                await self.tick()
            except Exception:  # the store unreachable for a while: try again next time
                log.exception("the node-loss sweep failed; trying again")
            if task is not None and task.cancelling():
                # Stopping, and a callee swallowed the cancel (stopping a standby sandbox
                # suppresses everything): end here rather than sweep on forever.
                raise asyncio.CancelledError
            await asyncio.sleep(self.interval)

    async def tick(self, now: datetime | None = None) -> list[Take]:
        """One round; returns what this node took (adopted or released)."""
        now = now or datetime.now(UTC)
        await self._fence()
        nodes = await self.store.list_nodes()
        mine = next((n for n in nodes if n.id == self.me), None)
        if mine is not None and mine.draining:
            await self._drain()
            return []
        await self._release_hibernated()
        orphans: list[StoredSession] = []
        for n in nodes:
            if n.id != self.me and not n.alive(now):
                orphans += await self.store.sessions_on(n.id)
        known = {n.id for n in nodes}
        orphans += [s for s in await self.store.expired_leases(now) if s.node not in known]
        takes = plan(nodes, orphans, self.me, now, grace=self.grace)
        rows = {s.id: s for s in orphans}
        won = await asyncio.gather(*(self._take(t, rows[t.session_id]) for t in takes))
        return [t for t, ok in zip(takes, won, strict=True) if ok]

    async def _take(self, take: Take, stored: StoredSession) -> bool:
        async with self._slots:
            try:
                if take.kind == "release":
                    return await self._release(take.session_id, take.from_node)
                return await self._adopt(stored)
            except KernelhubError as exc:
                log.warning("taking session %s from %s failed: %s", take.session_id,
                            take.from_node, exc)  # fmt: skip
                return False
