"""Whose batch item starts next: fair turns between principals.

Items wait in one lane per batch; a principal's lanes are served in the order the
batches came. Between principals the turn goes round: the principal served least
recently goes first, so a principal with a thousand queued items and one with two take
slots alternately. Three caps bound what runs: over all (``concurrency``), per principal
(``per_principal``, below ``concurrency`` by default so one principal never holds every
slot while another waits) and per batch (the batch's own ``concurrency``).

Pure: no I/O, no clock, no asyncio. The runner calls :meth:`FairQueue.next` whenever a
slot may have freed (a batch came, an item ended) until it answers None, and
:meth:`FairQueue.done` when an item it started has ended.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


def principal_cap(concurrency: int, configured: int | None) -> int:
    """The items one principal may run at once: ``configured``, or by default half the
    slots (rounded up), so another principal's batch always finds one free."""
    return configured if configured is not None else math.ceil(concurrency / 2)


@dataclass
class _Lane(Generic[T]):
    cap: int
    waiting: deque[T] = field(default_factory=deque)
    running: int = 0


@dataclass
class _Principal(Generic[T]):
    lanes: OrderedDict[str, _Lane[T]] = field(default_factory=OrderedDict)  # batch id ->
    running: int = 0


class FairQueue(Generic[T]):
    """Queued batch items of every principal (see the module)."""

    def __init__(self, concurrency: int, per_principal: int) -> None:
        if concurrency < 1 or per_principal < 1:
            raise ValueError(f"caps must be at least 1, not {concurrency}, {per_principal}")
        self.concurrency = concurrency
        self.per_principal = per_principal
        self.running = 0
        # Least recently served first: a principal moves to the end when it gets a slot.
        self._principals: OrderedDict[str, _Principal[T]] = OrderedDict()
        self._owners: dict[str, str] = {}  # batch id -> principal

    @property
    def waiting(self) -> int:
        return sum(
            len(lane.waiting) for p in self._principals.values() for lane in p.lanes.values()
        )

    def add(self, principal: str, batch: str, items: Iterable[T], cap: int) -> None:
        """Queue a batch's items, in order, at most ``cap`` of them running at once."""
        if batch in self._owners:
            raise ValueError(f"batch {batch!r} is queued already")
        lane: _Lane[T] = _Lane(cap=cap, waiting=deque(items))
        if not lane.waiting:
            return
        self._owners[batch] = principal
        self._principals.setdefault(principal, _Principal()).lanes[batch] = lane

    def next(self) -> tuple[str, T] | None:
        """The batch id and item that start now (counted as running until :meth:`done`),
        or None while every cap is reached or nothing waits."""
        if self.running >= self.concurrency:
            return None
        for name, principal in self._principals.items():
            if principal.running >= self.per_principal:
                continue
            for batch, lane in principal.lanes.items():
                if lane.waiting and lane.running < lane.cap:
                    item = lane.waiting.popleft()
                    lane.running += 1
                    principal.running += 1
                    self.running += 1
                    self._principals.move_to_end(name)
                    return batch, item
        return None

    def done(self, batch: str) -> None:
        """An item of ``batch`` that :meth:`next` started has ended: its slot is free."""
        principal = self._principals[self._owners[batch]]
        lane = principal.lanes[batch]
        if lane.running < 1:
            raise ValueError(f"batch {batch!r} has no running item to end")
        lane.running -= 1
        principal.running -= 1
        self.running -= 1
        self._forget_if_empty(batch)

    def drop(self, batch: str) -> list[T]:
        """Take a batch's waiting items out of the queue (it was cancelled); its running
        ones keep their slots until :meth:`done`."""
        owner = self._owners.get(batch)
        if owner is None:
            return []
        lane = self._principals[owner].lanes[batch]
        dropped = list(lane.waiting)
        lane.waiting.clear()
        self._forget_if_empty(batch)
        return dropped

    def _forget_if_empty(self, batch: str) -> None:
        owner = self._owners[batch]
        principal = self._principals[owner]
        lane = principal.lanes[batch]
        if lane.waiting or lane.running:
            return
        del principal.lanes[batch], self._owners[batch]
        if not principal.lanes:
            del self._principals[owner]
