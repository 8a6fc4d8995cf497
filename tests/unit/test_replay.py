"""The replay core with data: a store that grows, a live feed that repeats, reorders and
drops, and readers that reconnect at every position. The oracle is the log itself: every
event after ``since``, once, in order; and the payloads (consecutive numbers a cell
printed) come out with no gap and no duplicate."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kernelhub.replay import Phase, Replay, Verdict

# -- a model of the gateway's shell (gateway/stream.py::_send_events) ------------------


@dataclass
class Gateway:
    """The store (committed events) and one reader's live feed, driven by ``ops``:
    ``("commit", seq)`` stores an event; ``("offer", seq, prev)`` offers it live;
    ``("overflow",)`` says the reader's buffer was dropped (what it held is lost)."""

    page_size: int = 2
    store: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)

    def page(self, after: int) -> list[tuple[int, str]]:
        rows = [s for s in sorted(self.store) if s > after][: self.page_size]
        return [(s, f"body{s}") for s in rows]

    def catch_up(self, replay: Replay) -> None:
        while replay.replaying:
            for seq, body in replay.page(self.page(replay.last)):
                assert body == f"body{seq}"
                self.sent.append(seq)
                replay.delivered(seq)

    def serve(self, since: int, ops: list[tuple[object, ...]]) -> list[int]:
        replay = Replay(since)
        self.catch_up(replay)
        for op in ops:
            if op[0] == "commit":
                self.store.append(int(op[1]))  # type: ignore[call-overload]
                continue
            if op[0] == "overflow":
                replay.fell_behind()
            else:
                _, seq, prev = op
                verdict = replay.judge(seq, prev)  # type: ignore[arg-type]
                if verdict is Verdict.GAP:
                    replay.fell_behind()
                elif verdict is Verdict.DELIVER:
                    self.sent.append(seq)  # type: ignore[arg-type]
                    replay.delivered(seq)  # type: ignore[arg-type]
            self.catch_up(replay)
        return self.sent


def publication(seqs: list[int]) -> list[tuple[object, ...]]:
    """Each event committed, then offered with the seq published before it."""
    ops: list[tuple[object, ...]] = []
    prev = 0
    for seq in seqs:
        ops += [("commit", seq), ("offer", seq, prev)]
        prev = seq
    return ops


# Not consecutive on purpose: silent calls take numbers, retention deletes rows.
LOG = [1, 2, 3, 5, 6, 9, 10, 11, 14, 15]


def test_replays_the_store_then_goes_live() -> None:
    gateway = Gateway(store=LOG[:4])
    assert gateway.serve(0, publication(LOG[4:])) == LOG


@pytest.mark.parametrize("since", [0, 1, 3, 4, 9, 15, 20])
def test_since_skips_what_the_reader_has(since: int) -> None:
    gateway = Gateway(store=LOG[:6])
    assert gateway.serve(since, publication(LOG[6:])) == [s for s in LOG if s > since]


@pytest.mark.parametrize("split", range(len(LOG) + 1))
def test_live_events_that_were_replayed_are_dropped(split: int) -> None:
    # The subscriber is armed before the replay: what the replay sent comes again live.
    ops = [("offer", s, p) for s, p in zip(LOG[:split], [0, *LOG][:split], strict=True)]
    gateway = Gateway(store=LOG[:split])
    assert gateway.serve(0, ops + publication(LOG[split:])) == LOG


def test_duplicated_offers_are_sent_once() -> None:
    ops = []
    for op in publication(LOG):
        ops += [op, op] if op[0] == "offer" else [op]
    assert Gateway().serve(0, ops) == LOG


@pytest.mark.parametrize("lost", range(len(LOG)))
def test_an_overflow_catches_up_from_the_store(lost: int) -> None:
    ops: list[tuple[object, ...]] = []
    for op in publication(LOG):
        if op[0] == "offer" and op[1] == LOG[lost]:
            op = ("overflow",)
        ops.append(op)
    assert Gateway().serve(0, ops) == LOG


@pytest.mark.parametrize("late", range(len(LOG) - 1))
def test_an_event_offered_before_its_predecessor_is_a_gap(late: int) -> None:
    # LOG[late] is committed but its offer arrives after its successor's.
    ops = publication(LOG)
    first = ops.index(("offer", LOG[late], LOG[late - 1] if late else 0))
    delayed = ops.pop(first)
    ops.insert(ops.index(("offer", LOG[late + 1], LOG[late])) + 1, delayed)
    assert Gateway().serve(0, ops) == LOG


def test_without_prev_a_reordered_feed_loses_the_late_event() -> None:
    """Why ``prev`` is there: dedupe by seq alone cannot tell a late event from a repeat."""
    replay = Replay(0, live=True)
    assert replay.live(1) is Verdict.DELIVER
    assert replay.live(3) is Verdict.DELIVER
    assert replay.live(2) is Verdict.DUPLICATE  # lost, had the source not given prev
    checked = Replay(1, live=True)
    assert checked.live(3, prev=2) is Verdict.GAP
    assert checked.last == 1


@pytest.mark.parametrize("seed", range(40))
def test_a_random_misbehaving_feed_delivers_the_log_exactly(seed: int) -> None:
    rng = random.Random(seed)
    seqs = sorted(rng.sample(range(1, 80), 30))
    start = rng.randrange(len(seqs))
    since = rng.choice([0, seqs[start - 1] if start else 0])
    ops: list[tuple[object, ...]] = []
    delayed: list[tuple[object, ...]] = []
    prev = seqs[start - 1] if start else 0
    for seq in seqs[start:]:
        ops.append(("commit", seq))
        offer = ("offer", seq, prev)
        prev = seq
        roll = rng.random()
        if roll < 0.15:
            ops.append(("overflow",))
        elif roll < 0.3:
            delayed.append(offer)
        elif roll < 0.45:
            ops += [offer, offer]
        else:
            ops.append(offer)
        if delayed and rng.random() < 0.5:
            ops.append(delayed.pop(0))
    ops += delayed
    gateway = Gateway(page_size=rng.randint(1, 5), store=seqs[:start])
    sent = gateway.serve(since, ops)
    assert sent == [s for s in seqs if s > since]


# -- the SDK's side: the gateway replays after each connection's `since` ---------------


def connection(log: list[tuple[int, int]], since: int, resend: int) -> list[object]:
    """What one WebSocket connection carries: a hello with the newest seq, then the events
    after ``since`` — and, from a sloppy gateway, ``resend`` more before them."""
    head = log[-1][0] if log else 0
    after = [e for e in log if e[0] > since]
    before = [e for e in log if e[0] <= since][-resend:] if resend else []
    return [("hello", head), *before, *after]


def read(log: list[tuple[int, int]], since: int, cuts: list[int], resend: int) -> list[int]:
    """The SDK's reader (client/_stream.py::EventStream.receive): reconnects with the
    newest seq it returned after each cut (``cuts``: frames a connection carries)."""
    replay = Replay(since, live=True)
    printed: list[int] = []
    for cut in [*cuts, 10**9]:
        frames = connection(log, replay.last, resend)[: cut + 1]
        kind, head = frames[0]  # type: ignore[misc]
        assert kind == "hello" and not replay.lost(head)
        for seq, number in frames[1:]:  # type: ignore[misc]
            if replay.live(seq) is Verdict.DELIVER:
                printed.append(number)
    return printed


# A cell printed 0..N-1, one event per number; the seqs have holes.
PRINTED = [(seq, n) for n, seq in enumerate(s for s in range(1, 60) if s % 7)]


@pytest.mark.parametrize("cut", range(len(PRINTED) + 2))
@pytest.mark.parametrize("resend", [0, 3])
def test_a_reconnect_at_every_position_loses_and_repeats_nothing(cut: int, resend: int) -> None:
    printed = read(PRINTED, 0, [cut, cut, 1], resend)
    assert printed == list(range(len(PRINTED)))  # consecutive: no gap, no duplicate


def test_reconnecting_after_every_frame() -> None:
    assert read(PRINTED, 0, [1] * len(PRINTED), resend=2) == list(range(len(PRINTED)))


def test_since_in_the_middle_of_the_log() -> None:
    seq, number = PRINTED[20]
    assert read(PRINTED, seq, [5], resend=1) == list(range(number + 1, len(PRINTED)))


def test_a_source_behind_the_reader_lost_events() -> None:
    replay = Replay(10, live=True)
    assert replay.lost(9)
    assert not replay.lost(10)
    assert not replay.lost(11)


# -- the contract's edges --------------------------------------------------------------


def test_phases_and_verdicts() -> None:
    replay = Replay(2)
    assert replay.phase is Phase.REPLAY and replay.replaying
    assert replay.judge(5) is Verdict.GAP  # live events wait while the log is read
    assert replay.judge(2) is Verdict.DUPLICATE
    assert replay.page([(4, "d"), (3, "c"), (1, "a"), (3, "c")]) == [(3, "c"), (4, "d")]
    assert replay.last == 2  # nothing counts as delivered until the shell says so
    replay.delivered(3)
    assert replay.page([(3, "c")]) == []
    assert replay.phase is Phase.LIVE
    assert replay.judge(4, prev=3) is Verdict.DELIVER
    assert replay.judge(5, prev=4) is Verdict.GAP
    assert replay.judge(5, prev=7) is Verdict.DELIVER  # a prev past seq is nonsense: ignored
    replay.delivered(2)
    assert replay.last == 3  # never backwards
    assert repr(replay) == "Replay(last=3, phase=live)"
    replay.fell_behind()
    assert replay.replaying


def test_a_page_in_the_live_phase_is_refused() -> None:
    with pytest.raises(RuntimeError, match="phase live"):
        Replay(0, live=True).page([(1, "a")])


def test_since_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="got -1"):
        Replay(-1)
