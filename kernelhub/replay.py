"""Replay, then live: one reader's view of a session's event log, each ``seq`` once, in order.

A reader (a WebSocket client on the gateway, an SDK stream) wants every event after the
``since`` it names. The events come from two places: the *log* (the store, or the
gateway's replay on a new connection), read page by page, and the *live* feed, which
overlaps the log (events published while the replay ran), may repeat what a reconnect
already replayed, and may drop what a slow reader could not take. This module decides,
without I/O, what to do with each of them — the way ``websockets``' ``Protocol`` takes
bytes in and gives events out. The gateway's ``stream.py`` and the SDK's ``_stream.py``
are its I/O shells.

Calling contract (one :class:`Replay` per reader, used from one task):

- ``phase`` says where the next events come from. While it is ``REPLAY``, the shell reads
  the log after :attr:`Replay.last` and passes each page to :meth:`Replay.page`, which
  returns the rows to deliver, and calls :meth:`Replay.delivered` for each once it is
  delivered; a page with nothing new means the log is exhausted: phase ``LIVE``.
- In ``LIVE``, each live event goes to :meth:`Replay.judge` (no state change) and, once
  the shell has delivered it, :meth:`Replay.delivered`; or to :meth:`Replay.live`, which
  does both when delivering cannot fail. The verdict is ``DELIVER``, ``DUPLICATE`` (drop
  it) or ``GAP``: the event's predecessor (``prev``) was never delivered, so the shell
  calls :meth:`Replay.fell_behind` and reads the log again; the event is in it.
- :meth:`Replay.fell_behind` also serves when the live feed dropped events (a subscriber
  over its budget, a socket that broke): back to ``REPLAY`` from :attr:`Replay.last`.
- :meth:`Replay.lost` checks a source's newest ``seq`` (a hello frame's ``last_seq``)
  against what was delivered: a source behind the reader has lost events.

Sequence numbers need not be consecutive (kernelhub's own silent calls take numbers
that reach no reader, retention deletes old rows), which is why a gap is known only from
``prev``, the seq of the event published just before, when the source gives it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["Phase", "Replay", "Verdict"]


class Phase(enum.Enum):
    REPLAY = "replay"  # read the log after ``last``
    LIVE = "live"  # take the live feed


class Verdict(enum.Enum):
    DELIVER = "deliver"  # new: hand it to the reader
    DUPLICATE = "duplicate"  # delivered already (or older than ``since``): drop it
    GAP = "gap"  # something before it was missed: catch up from the log first


class Replay:
    """The state of one reader: the newest seq delivered, and where the next come from.

    ``live=True`` starts in ``LIVE``, for a shell whose source replays by itself (the SDK:
    the gateway replays after the ``since`` of each connection)."""

    def __init__(self, since: int = 0, *, live: bool = False) -> None:
        if since < 0:
            raise ValueError(f"since must be a non-negative integer, got {since}")
        self.last = since
        self.phase = Phase.LIVE if live else Phase.REPLAY

    def __repr__(self) -> str:
        return f"Replay(last={self.last}, phase={self.phase.value})"

    @property
    def replaying(self) -> bool:
        return self.phase is Phase.REPLAY

    def page(self, rows: Iterable[tuple[int, T]]) -> list[tuple[int, T]]:
        """Of a page read from the log after :attr:`last`, the rows to deliver, in seq
        order and each once; the shell calls :meth:`delivered` for each as it goes (so a
        page cut short by a broken socket is read again from where it stopped). A page
        with nothing new ends the replay."""
        if self.phase is not Phase.REPLAY:
            raise RuntimeError(f"a log page was given to a reader in phase {self.phase.value}")
        fresh: list[tuple[int, T]] = []
        newest = self.last
        for seq, item in sorted(rows, key=lambda row: row[0]):
            if seq > newest:
                fresh.append((seq, item))
                newest = seq
        if not fresh:
            self.phase = Phase.LIVE
        return fresh

    def judge(self, seq: int, prev: int | None = None) -> Verdict:
        """What to do with live event ``seq``; ``prev``, if the source knows it, is the
        seq of the event published just before it. Changes nothing."""
        if seq <= self.last:
            return Verdict.DUPLICATE
        if self.phase is Phase.REPLAY:
            return Verdict.GAP  # the log comes first: this event waits in it
        if prev is not None and self.last < prev < seq:
            return Verdict.GAP
        return Verdict.DELIVER

    def delivered(self, seq: int) -> None:
        """Event ``seq`` (from a page, or live) reached the reader."""
        self.last = max(self.last, seq)

    def live(self, seq: int, prev: int | None = None) -> Verdict:
        """:meth:`judge`, and :meth:`delivered` if the verdict is ``DELIVER``."""
        verdict = self.judge(seq, prev)
        if verdict is Verdict.DELIVER:
            self.last = seq
        return verdict

    def fell_behind(self) -> None:
        """The live feed missed events (dropped, overflowed, or a ``GAP``): read the log
        again from :attr:`last`."""
        self.phase = Phase.REPLAY

    def lost(self, head: int) -> bool:
        """Whether a source whose newest seq is ``head`` has lost events this reader got."""
        return head < self.last
