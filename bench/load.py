"""Load sections: many sessions at once, and one very large output.

Floors: as many stock ipykernels (host processes, each driven by its own jupyter_client)
as kernelhub has sessions, doing the same cells; the peer: Jupyter Kernel Gateway with
TCP_NODELAY and as many kernels, up to ``Plan.peer_sessions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import gateway
from floor import FloorKernel
from gateway import WsSession
from harness import SMALL_LIMITS, SMALL_SESSION, Suite, gather_limited
from peers import PEERS, Peer, PeerKernel
from report import MiB, Row, Unavailable, mib, ms, quantile, seconds, spread, times
from rounds import Rounds, Spread, interleave
from targets import at_least, at_most

PEER = "jkg+nd"
Cell = Callable[[], Awaitable[float]]


def p99(samples: Sequence[float]) -> float:
    return quantile(samples, 0.99)


def burst(
    cells: list[Cell], k: int, latencies: list[list[float]]
) -> Callable[[], Awaitable[float]]:
    """A runner for :func:`rounds.interleave`: every session runs ``k`` cells one after the
    other, all sessions at once; it returns the wall time and files the cells' latencies
    as a new round of ``latencies``."""

    async def run() -> float:
        mine: list[float] = []

        async def session(cell: Cell) -> None:
            for _ in range(k):
                mine.append(await cell())

        t0 = time.perf_counter()
        await asyncio.gather(*(session(cell) for cell in cells))
        wall = time.perf_counter() - t0
        latencies.append(mine)
        return wall

    return run


async def concurrency(suite: Suite) -> list[Row]:
    section = "concurrency"
    plan = suite.plan
    rows: list[Row] = []
    startup: list[str] = []
    levels: dict[int, dict[str, dict[str, Spread]]] = {}
    sids: list[str] = []  # grown level by level: exactly n alive at level n
    floors: list[FloorKernel] = []
    try:
        for n in sorted(plan.sessions):  # ascending: each level grows the last
            # The previous level's sessions and kernels stay: starting 160 of each for
            # 10/50/100 took most of the section's time on 2 cores; 100 are enough.
            t0 = time.perf_counter()
            more = n - len(sids)
            sids += await gather_limited(
                8, [partial(gateway.create_session, suite.http, SMALL_SESSION)] * more
            )
            up = f"{n} (+{more}): kernelhub {seconds(time.perf_counter() - t0)}"
            peer: Peer | None = None
            peer_kernels: list[PeerKernel] = []
            try:
                t0 = time.perf_counter()
                floors += await gather_limited(
                    8, [partial(FloorKernel.start, suite.root)] * (n - len(floors))
                )
                up += f", stock kernels {seconds(time.perf_counter() - t0)}"
                if n <= plan.peer_sessions:
                    t0 = time.perf_counter()
                    try:
                        peer = await Peer.launch(PEERS[PEER], suite.root)
                        peer_kernels = await gather_limited(4, [peer.kernel] * n)
                    except (Unavailable, RuntimeError, TimeoutError, OSError) as exc:
                        # The peer failing to start n kernels is its result, not the section's.
                        suite.note(section, f"{PEERS[PEER].label} at {n} sessions: {exc!r}.")
                        peer_kernels = []
                    up += f", {PEERS[PEER].label} {seconds(time.perf_counter() - t0)}"
                async with contextlib.AsyncExitStack() as stack:
                    clients = [
                        await stack.enter_async_context(WsSession(suite.gw, sid)) for sid in sids
                    ]
                    contenders: dict[str, list[Cell]] = {
                        "kernelhub": [partial(ws.run, "1+1") for ws in clients],
                        "floor": [f.roundtrip for f in floors],
                    }
                    if peer_kernels:
                        contenders["peer"] = [k.roundtrip for k in peer_kernels]
                    for cells in contenders.values():  # one untimed cell each
                        await asyncio.gather(*(cell() for cell in cells))
                    latencies: dict[str, list[list[float]]] = {name: [] for name in contenders}
                    s = await interleave(
                        {name: burst(cells, plan.cells, latencies[name])
                         for name, cells in contenders.items()},
                        rounds=plan.rounds, per_round=1,
                    )  # fmt: skip
            finally:
                if peer is not None:
                    await peer.stop()
            startup.append(up)
            lat = Rounds(latencies)
            rate = {
                name: Spread.of([n * plan.cells / w[0] for w in s.samples[name]])
                for name in s.names
            }
            levels[n] = {name: {"rate": rate[name], "p50": lat.spread(name),
                                "p99": lat.spread(name, p99)} for name in s.names}  # fmt: skip
            floor_rate = f"{rate['floor'].median:.0f}/s ({n} stock kernels)"
            floor_p99 = f"{ms(lat.spread('floor', p99).median)} ({n} stock kernels)"
            rate_ratio = Spread.of(
                [
                    b[0] / a[0]
                    for a, b in zip(s.samples["kernelhub"], s.samples["floor"], strict=True)
                ]
            )  # throughput: the floor's wall time over ours, round by round
            targeted = n in (50, 100)  # the levels the targets name
            p99_ratio = lat.ratio("kernelhub", "floor", p99)
            rows += [
                Row(section, f"{n} sessions × {plan.cells} cells a round: throughput",
                    spread(rate["kernelhub"], lambda x: f"{x:.0f}/s"), floor_rate, times(rate_ratio),
                    at_least(0.9) if targeted else "", rate_ratio if targeted else None),
                Row(section, f"{n} sessions: cell latency p99", spread(lat.spread("kernelhub", p99)),
                    floor_p99, times(p99_ratio), at_most(1.5) if targeted else "",
                    p99_ratio if targeted else None),
            ]  # fmt: skip
            if "peer" in s.samples:
                label = PEERS[PEER].label
                rows += [
                    Row(section, f"{n} sessions: throughput, {label}",
                        spread(rate["peer"], lambda x: f"{x:.0f}/s"), floor_rate,
                        f"{rate['peer'].median / rate['floor'].median:.2f}×"),
                    Row(section, f"{n} sessions: cell latency p99, {label}",
                        spread(lat.spread("peer", p99)), floor_p99,
                        times(lat.ratio("peer", "floor", p99))),
                ]  # fmt: skip
    finally:
        await gather_limited(8, [partial(gateway.delete_session, suite.http, sid) for sid in sids])
        await asyncio.gather(*(f.stop() for f in floors))

    suite.series["concurrency"] = levels
    suite.note(
        section,
        f"At each level n: n kernelhub sessions with a {SMALL_LIMITS['memory_bytes'] // MiB} MiB"
        " memory limit, each with its own WebSocket client (connected before the clock starts);"
        " n stock ipykernels on the host, each driven by its own jupyter_client (the floor);"
        f" and, up to {plan.peer_sessions} sessions, {PEERS[PEER].label} with n kernels"
        " (host processes, unsandboxed), one WebSocket each. All alive together; started"
        " 8 at a time, untimed, each level adding to the previous level's sessions and"
        " kernels (the peer starts afresh at each level). A round: every session of one contender runs"
        f" {plan.cells} `1+1` cells one after the other, all sessions at once; {plan.rounds}"
        " interleaved rounds, the first contender rotating, after one untimed cell each."
        " Throughput: cells over the round's wall time; p99: over the round's cells; cells:"
        " median of rounds [min–max]; ratios per round. Starting them took "
        + "; ".join(startup)
        + ".",
    )
    return rows


async def big_output(suite: Suite) -> list[Row]:
    section = "output"
    growth: list[float] = []

    async def ours() -> float:
        elapsed, grew = await gateway.big_output(suite.gw, suite.http)
        growth.append(grew)
        return elapsed

    floor = await FloorKernel.start(suite.root)
    try:
        s = await interleave(
            {"floor": lambda: floor.roundtrip(gateway.BIG_OUTPUT), "kernelhub": ours},
            rounds=suite.plan.rounds,
            per_round=1,
        )
    finally:
        await floor.stop()
    suite.note(
        section,
        "One cell writes 500 lines of 100 kB to stdout. kernelhub: over the WebSocket to the"
        " `final` frame, while the gateway's RSS is sampled every 20 ms. Floor: the same cell"
        " in a stock ipykernel on the host, driven by jupyter_client to the reply and `idle`"
        f" (all output received). {suite.plan.rounds} interleaved rounds, rotating order.",
    )
    return [
        Row(section, "50 MB of output: wall time", spread(s.spread("kernelhub"), seconds),
            f"{seconds(s.spread('floor').median)} (stock ipykernel)",
            times(s.ratio("kernelhub", "floor"))),
        Row(section, "50 MB of output: gateway peak RSS growth", spread(Spread.of(growth), mib),
            "", "", at_most(16 * MiB, "bytes", issue="#20"), Spread.of(growth)),
    ]  # fmt: skip
