"""A node agent's heartbeat: its :class:`~kernelhub.cluster.models.NodeInfo` row in the
shared store every ``cluster.heartbeat_interval`` seconds, and its sessions' leases
renewed with it. Gateway replicas place new sessions by these rows; a row whose lease
ran out is a lost node (the failover sweep's business).

:func:`node_info` is the pure part (numbers in, the row out, tested with data);
:func:`measure` reads them off the machine and the session manager.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from datetime import datetime, timedelta

import psutil

from kernelhub import __version__
from kernelhub.cluster.models import NodeInfo
from kernelhub.errors import KernelhubError
from kernelhub.session.manager import SessionManager
from kernelhub.store.base import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """What a node measured of itself for one beat."""

    sessions: int  # live sessions held (running, paused, hibernated on this node)
    committed_bytes: int  # memory promised to them and to the warm pool
    budget_bytes: int  # what the node may promise in all (KERNELHUB_GATEWAY__MEMORY_BUDGET_BYTES)
    available_bytes: int  # what the machine has free right now
    load_1m: float  # the 1-minute load average
    cpus: int


def node_info(
    node_id: str,
    address: str,
    sample: Sample,
    *,
    started_at: datetime,
    now: datetime,
    lease_ttl: float,
    version: str = __version__,
) -> NodeInfo:
    """The row a beat writes. Free memory is what the node can still promise a sandbox:
    its budget less what it promised, and never more than the machine has (nodes sharing
    a machine, or other processes, use the same RAM)."""
    free = min(max(0, sample.budget_bytes - sample.committed_bytes), sample.available_bytes)
    return NodeInfo(
        id=node_id,
        address=address,
        started_at=started_at,
        heartbeat_at=now,
        lease_expires_at=now + timedelta(seconds=lease_ttl),
        sessions=max(0, sample.sessions),
        memory_total_bytes=max(0, sample.budget_bytes),
        memory_free_bytes=max(0, free),
        cpu_load=max(0.0, sample.load_1m / max(1, sample.cpus)),
        version=version,
    )


def measure(manager: SessionManager) -> Sample:
    sessions, committed = manager.load()
    return Sample(
        sessions=sessions,
        committed_bytes=committed,
        budget_bytes=manager.memory_budget,
        available_bytes=int(psutil.virtual_memory().available),
        load_1m=os.getloadavg()[0],
        cpus=os.cpu_count() or 1,
    )


class Heartbeat:
    """Writes the node's row and renews its leases; ``run`` until cancelled. A beat that
    fails (the store away for a moment) is logged and retried at the next interval: the
    lease is ``lease_ttl`` long precisely so that one missed beat loses nothing."""

    def __init__(
        self,
        store: Store,
        manager: SessionManager,
        *,
        node_id: str,
        address: str,
        interval: float,
        lease_ttl: float,
        started_at: datetime,
    ) -> None:
        self.store = store
        self.manager = manager
        self.node_id = node_id
        self.address = address
        self.interval = interval
        self.lease_ttl = lease_ttl
        self.started_at = started_at

    async def beat(self) -> NodeInfo:
        now = datetime.now(self.started_at.tzinfo)
        info = node_info(
            self.node_id,
            self.address,
            measure(self.manager),
            started_at=self.started_at,
            now=now,
            lease_ttl=self.lease_ttl,
        )
        await self.store.upsert_node(info)
        await self.store.renew_leases(self.node_id, info.lease_expires_at)
        return info

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.beat()
            except KernelhubError as exc:
                log.warning("heartbeat of node %s failed: %s", self.node_id, exc)
