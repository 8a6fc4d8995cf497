"""Node loss and draining (issue #24), as the session manager sees them: one collaborator
that holds the node's :class:`~kernelhub.cluster.adopt.Adoption`, its checkpoint export
and its sweep loop. On one machine (no ``KERNELHUB_CLUSTER__ADDRESS``) every part is
inert: the manager holds every row, exports nothing, sweeps nothing.

The manager calls ``claim_released`` when a call names a session it does not hold and
``after_cell`` as each kernel's hook; a node agent runs :meth:`run` as one of its node
tasks (``kernelhub.cluster.node``), after its first heartbeat.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from kernelhub.cluster.adopt import Adoption
from kernelhub.cluster.export import CheckpointExport
from kernelhub.cluster.sweep import Sweeper
from kernelhub.config import Limits, Settings
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.base import SandboxBackend
from kernelhub.session.continuity import Continuity
from kernelhub.session.live import LiveSession
from kernelhub.session.recorder import Recorder
from kernelhub.session.recovery import SessionRecovery
from kernelhub.store.base import Store
from kernelhub.store.records import StoredSession


class Failover:
    def __init__(
        self,
        settings: Settings,
        backend: SandboxBackend,
        store: Store,
        recorder: Recorder,
        continuity: Continuity,
        recovery: SessionRecovery,
        sessions: dict[str, LiveSession],
        *,
        live: Callable[[StoredSession, Limits], LiveSession],
        bind: Callable[[LiveSession, KernelSession], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self.adoption = a = Adoption(
            settings, backend, store, recorder, continuity, recovery, sessions,
            live=live, bind=bind,
        )  # fmt: skip
        self.export = CheckpointExport(settings, store, continuity, enabled=a.enabled, spawn=spawn)
        c = settings.cluster
        self.sweeper = Sweeper(
            store, a.me, interval=c.heartbeat_interval, grace=c.lease_ttl,
            concurrency=c.adopt_concurrency, fence=a.fence, drain=a.drain, adopt=a.adopt,
            release=a.release, release_hibernated=a.release_hibernated,
        )  # fmt: skip
        self.claim_released = a.claim_released
        self.after_cell = self.export.after_cell

    async def run(self) -> None:
        """The sweep loop (see :class:`~kernelhub.cluster.sweep.Sweeper`), on a node agent
        only."""
        if self.adoption.enabled:
            await self.sweeper.run()
