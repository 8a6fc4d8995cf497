"""Automatic checkpoints, off the critical path of the cells they follow.

A cell's reply and record never wait for its checkpoint: it is armed when the cell ends
and taken once the session has been idle ``checkpoint_grace`` seconds, as the kernel's
next item (a cell already queued runs first; the checkpoint after it covers both).

The grace is a choice between two guarantees, both precise:

- 0 (the default): a checkpoint after every cell. Crash recovery comes back to the last
  cell and rewind reaches the state before any cell; a cell sent while the previous
  cell's checkpoint runs waits for its end (incremental: ~5-15 ms on ~100 MiB of state).
- more (e.g. 0.05 s): a burst of cells sent back to back gets one checkpoint, once it
  ends, and none waits: on a session with ~100 MiB of state, checkpoints after each of
  a burst of back-to-back cells more than doubled their latency (``bench/checkpoints.py``).
  A crash inside a burst comes back to the checkpoint before it, and the recovery names
  every execution since (``RecoveryInfo.lost``); rewind reaches the state before a cell
  that followed that much idle time, and inside a burst goes back to the checkpoint
  before it, naming the cells that undoes too.

A cell that changed nothing a checkpoint keeps (``1+1``, ``print(df.shape)``) takes no
capture at all: the kernel says so in its execute_reply (``kernelhub_unchanged_since``,
the name of its last capture) and the cell is recorded as covered by that checkpoint,
``(count, same name)``; a directory goes only when no entry names it. Images that never
say so get a capture after every cell, as before.

An agent thinking between cells (seconds, usually) gets a checkpoint after each cell
either way, for none of its cells' time. Used by
:class:`~kernelhub.session.continuity.Continuity`, which owns the rest of the session's
continuity (rewind, recovery, hibernation read ``LiveSession.checkpoints``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from kernelhub.config import Settings
from kernelhub.errors import KernelhubError
from kernelhub.execution import ops
from kernelhub.execution.engine import ExecutionHandle, KernelSession
from kernelhub.models import ExecutionStatus
from kernelhub.session.live import LiveSession
from kernelhub.snapshot import calls

log = logging.getLogger(__name__)

# A cell that ran leaves state worth keeping, whatever its outcome (one that raised may
# have bound half its names); cancelled, timed-out-and-restarted or dead ones do not run
# a checkpoint (the kernel is gone, or was restarted empty).
_CHECKPOINTED = frozenset(
    {ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.INTERRUPTED}
)
# While the kernel is busy with something that is not a user cell (a snapshot, a file
# call), a due checkpoint looks again this often; a user cell re-arms it when it ends.
_BUSY_RECHECK_INTERVAL = 0.5


def checkpoint_delay(
    policy: str | float, grace: float, now: float, last_checkpoint_at: float
) -> float | None:
    """Seconds from now until a cell's checkpoint is due, or None for none at all: the
    grace, and with a numeric policy (at most one every ``policy`` seconds) no sooner
    than that long after the last one."""
    if policy == "off":
        return None
    if isinstance(policy, float):
        return max(grace, last_checkpoint_at + policy - now)
    return grace


def unreferenced(dropped: list[tuple[int, str]], kept: list[tuple[int, str]]) -> list[str]:
    """The checkpoint directories of ``dropped`` entries no ``kept`` entry names, each once
    (a cell that changed nothing shares the directory of the checkpoint before it)."""
    still = {name for _, name in kept}
    return list(dict.fromkeys(name for _, name in dropped if name not in still))


def alias_for(
    checkpoints: list[tuple[int, str]], unchanged_since: str | None, pending: bool
) -> str | None:
    """The checkpoint a cell that the kernel reported unchanged since ``unchanged_since``
    is covered by: the session's last one, if that is the capture the kernel means and no
    other capture is pending (it would cover the cell anyway). None: capture as usual."""
    if unchanged_since is None or pending or not checkpoints:
        return None
    return unchanged_since if checkpoints[-1][1] == unchanged_since else None


def next_count_after(checkpoints: list[tuple[int, str]], after: int, name: str) -> int | None:
    """The execution count to restore with checkpoint ``(after, name)``: None for its own
    capture's, ``after + 1`` when it is an alias (an earlier entry took that directory)."""
    first = next((count for count, n in checkpoints if n == name), after)
    return None if first == after else after + 1


class Checkpoints:
    """Schedules and takes the automatic checkpoints of every session (see the module).
    ``spawn``: run a task the session manager owns."""

    # Rewind reaches back this many checkpoints; most of their files are hard links to
    # each other's, and a full state directory drops the oldest (see _take).
    MAX_CHECKPOINTS = 256

    def __init__(
        self, settings: Settings, spawn: Callable[[Coroutine[Any, Any, Any]], None]
    ) -> None:
        self.settings = settings
        self._spawn = spawn

    def cell_ended(self, live: LiveSession, kernel: KernelSession, handle: ExecutionHandle) -> None:
        """The engine's ``after_cell`` (through Continuity): a user cell ended. Arms (or
        re-arms) the session's checkpoint; never waits for it."""
        record = handle.record
        if record is None or record.status not in _CHECKPOINTED:
            return
        if self._covered(live, kernel, handle, record.execution_count or 0):
            return
        now = time.monotonic()
        delay = checkpoint_delay(
            live.checkpoint_policy, self.settings.gateway.checkpoint_grace, now,
            live.last_checkpoint_at,
        )  # fmt: skip
        if delay is None:
            return
        live.checkpoint_count = record.execution_count or 0
        self._arm(live, kernel, delay)

    def _covered(
        self, live: LiveSession, kernel: KernelSession, handle: ExecutionHandle, count: int
    ) -> bool:
        """A cell that changed nothing a checkpoint keeps (the kernel said so in its
        reply) is covered by the last checkpoint: recorded as ``(count, same name)``, so
        rewind to the cell after it and recovery find it, with no capture at all. Old
        images never say so: every cell gets its capture."""
        if live.checkpoint_policy == "off":
            return False
        pending = live.checkpoint_due is not None or live.checkpoint_count is not None
        name = alias_for(live.checkpoints, handle.unchanged_since, pending)
        if name is None:
            return False
        live.checkpoints.append((count, name))
        live.since_checkpoint.clear()  # the state is the checkpoint's: nothing is lost
        live.unchanged_execution = handle.id
        if len(live.checkpoints) > self.MAX_CHECKPOINTS:
            self._spawn(self._trim(live, kernel))
        return True

    async def _trim(self, live: LiveSession, kernel: KernelSession) -> None:
        """Drop the oldest entries past MAX_CHECKPOINTS, and the directories no entry
        left names."""
        excess = len(live.checkpoints) - self.MAX_CHECKPOINTS
        if excess <= 0:
            return
        dropped, live.checkpoints = live.checkpoints[:excess], live.checkpoints[excess:]
        for old in unreferenced(dropped, live.checkpoints):
            with contextlib.suppress(KernelhubError):
                await ops.run(kernel, calls.remove(old), timeout=60, background=True)

    @staticmethod
    def cancel(live: LiveSession) -> None:
        """Forget the session's pending checkpoint (a rewind, a restart, hibernation:
        what it would capture is not the state after the cell it was armed for)."""
        if live.checkpoint_due is not None:
            live.checkpoint_due.cancel()
        live.checkpoint_due, live.checkpoint_count = None, None
        live.checkpoint_epoch += 1

    def _arm(self, live: LiveSession, kernel: KernelSession, delay: float) -> None:
        if live.checkpoint_due is not None:
            live.checkpoint_due.cancel()
        loop = asyncio.get_running_loop()
        live.checkpoint_due = loop.call_later(delay, self._due, live, kernel)

    def _due(self, live: LiveSession, kernel: KernelSession) -> None:
        live.checkpoint_due = None
        if live.kernel is not kernel or not kernel.alive or live.checkpoint_policy == "off":
            return
        if kernel.paused:  # frozen: nothing may be sent to it; after it resumes
            self._arm(live, kernel, _BUSY_RECHECK_INTERVAL)
            return
        running = kernel.running
        if running is not None or kernel.queue_length:
            # A user cell re-arms it when it ends; anything else (a snapshot, a file
            # call) does not, so look again later.
            if running is None or running.internal is not None:
                self._arm(live, kernel, _BUSY_RECHECK_INTERVAL)
            return
        count, live.checkpoint_count = live.checkpoint_count, None
        if count is None:
            return
        epoch = live.checkpoint_epoch
        self._spawn(self._take_in_turn(live, kernel, count, epoch))

    async def _take_in_turn(
        self, live: LiveSession, kernel: KernelSession, count: int, epoch: int
    ) -> None:
        """The checkpoint, as the kernel's next item (a cell sent meanwhile runs after
        it). Dropped if it was cancelled while queued."""

        async def take() -> None:
            if live.checkpoint_epoch != epoch or live.kernel is not kernel:
                return
            await self._take(live, kernel, count)

        with contextlib.suppress(KernelhubError):
            await kernel.exclusive(take)

    async def _take(self, live: LiveSession, kernel: KernelSession, count: int) -> None:
        """An incremental capture inside the sandbox, kept there, the base of the next
        one. Runs with the kernel to itself (an exclusive operation)."""
        t0 = time.monotonic()
        covered = len(live.since_checkpoint)
        name = f"ckpt-{count}-{uuid.uuid4().hex[:6]}"
        base = live.checkpoints[-1][1] if live.checkpoints else None
        # Most often a failure is a full state directory (a large object changed, or a
        # capture that could not be incremental): the older checkpoints make room for the
        # newest, all but the last one first, then that one too.
        for attempt in range(3):
            try:
                await self._capture(live, kernel, name, base)
                break
            except KernelhubError as exc:
                if attempt == 2 or not live.checkpoints or live.checkpoint_policy == "off":
                    log.warning(
                        "checkpoint after cell %s of session %s failed: %s", count, live.id, exc
                    )
                    return
                keep = live.checkpoints[-1:] if attempt == 0 else []
                dropped = live.checkpoints[: len(live.checkpoints) - len(keep)]
                for old in unreferenced(dropped, keep):
                    await ops.run(kernel, calls.remove(old), timeout=60, background=True)
                live.checkpoints = keep
                base = keep[-1][1] if keep else None
        live.checkpoints.append((count, name))
        del live.since_checkpoint[:covered]
        live.last_checkpoint_at = t0
        log.debug(
            "checkpoint after cell %s of session %s: %.1f ms",
            count,
            live.id,
            (time.monotonic() - t0) * 1000,
        )
        await self._trim(live, kernel)

    async def _capture(
        self, live: LiveSession, kernel: KernelSession, name: str, base: str | None
    ) -> None:
        timeout = self.settings.gateway.checkpoint_timeout
        t0 = time.monotonic()
        try:
            # No result asked for: formatting the kernel's answer (every group, every
            # name) as JSON and parsing it here took 13 of a checkpoint's 33 ms, for
            # nothing a checkpoint uses; a failed capture still raises.
            await ops.run(kernel, calls.capture(name, base), timeout=timeout, background=True)
        except KernelhubError:
            with contextlib.suppress(KernelhubError):
                # what it left
                await ops.run(kernel, calls.remove(name), timeout=60, background=True)
            if time.monotonic() - t0 >= timeout:
                live.checkpoint_policy = "off"
                kernel.notice(
                    f"checkpoints are off for this session: one ran past {timeout:g} s "
                    "(KERNELHUB_GATEWAY__CHECKPOINT_TIMEOUT) and was interrupted, most likely "
                    "an object whose pickling stalls; crash recovery and rewind now have only "
                    "the checkpoints taken so far"
                )
            raise
