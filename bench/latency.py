"""Latency sections: ``1+1`` round trips and ``print`` to its first output.

Floors: a stock ipykernel driven by jupyter_client over ipc, and the same kernel driven by
a raw pyzmq client (``zmq_floor.py``). Peers: Jupyter Kernel Gateway and Jupyter Server,
each as shipped and with TCP_NODELAY (``peers.py``). Every contender runs in the same
interleaved rounds (``rounds.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import engine
import gateway
from floor import FIRST_PRINT, FIRST_PRINT_FLUSH
from harness import Suite
from peers import PEERS
from report import Row, ms, quantile, spread, times
from rounds import Rounds, interleave
from targets import Target, at_most
from zmq_floor import ZmqFloor

Runners = dict[str, Callable[[], Awaitable[float]]]


def peer_rows(
    section: str,
    s: Rounds,
    ours: str,
    floor: str,
    floor_text: str,
    what: str,
    targets: dict[str, Target],
) -> list[Row]:
    """Each peer's own number against the floor, then kernelhub's ``ours`` against it."""
    rows = []
    for key in (k for k in PEERS if k in s.samples):
        label = PEERS[key].label
        rows += [
            Row(section, f"{what}, {label}", spread(s.spread(key)), floor_text,
                times(s.ratio(key, floor))),
            Row(section, f"kernelhub WebSocket vs {label}", spread(s.spread(ours)),
                f"{ms(s.spread(key).median)} ({label})", times(s.ratio(ours, key)),
                targets.get(key, ""), s.ratio(ours, key) if key in targets else None),
        ]  # fmt: skip
    return rows


async def exec_roundtrip(suite: Suite) -> list[Row]:
    section = "exec"
    plan = suite.plan
    zmq_floor = await ZmqFloor.start(suite.root)
    try:
        async with suite.peer_kernels(section, PEERS) as peers:
            runners: Runners = {
                "floor": suite.floor.roundtrip,
                "zmq": zmq_floor.roundtrip,
                "engine": lambda: engine.roundtrip(suite.engine_session),
                "rest": lambda: gateway.rest_roundtrip(suite.http, suite.rest_sid),
                "raw": lambda: suite.raw.roundtrip(suite.rest_sid),
                "ws": lambda: suite.ws.run("1+1"),
                **{key: kernel.roundtrip for key, kernel in peers.items()},
            }
            s = await interleave(
                runners, rounds=plan.rounds, per_round=plan.exec_per_round, warmup=plan.warmup
            )
    finally:
        await zmq_floor.stop()
    floor = f"{ms(s.spread('floor').median)} (jupyter_client)"
    raw_floor = f"{ms(s.spread('zmq').median)} (raw pyzmq)"
    rows = [
        Row(section, "`1+1`, floor: stock ipykernel, jupyter_client over ipc",
            spread(s.spread("floor"))),
        Row(section, "`1+1`, floor: stock ipykernel, raw pyzmq client over ipc",
            spread(s.spread("zmq")), floor, times(s.ratio("zmq", "floor"))),
        Row(section, "`1+1`, engine in-process", spread(s.spread("engine")), floor,
            times(s.ratio("engine", "floor"))),
        Row(section, "`1+1`, gateway REST `wait=true`, httpx client", spread(s.spread("rest")),
            floor, times(s.ratio("rest", "floor"))),
        Row(section, "`1+1`, gateway REST `wait=true`, bare HTTP/1.1 client",
            spread(s.spread("raw")), floor, times(s.ratio("raw", "floor")),
            at_most(1.25), s.ratio("raw", "floor")),
        Row(section, "`1+1`, gateway WebSocket", spread(s.spread("ws")), floor,
            times(s.ratio("ws", "floor")), at_most(1.15), s.ratio("ws", "floor")),
        Row(section, "`1+1`, gateway WebSocket vs the raw pyzmq floor", spread(s.spread("ws")),
            raw_floor, times(s.ratio("ws", "zmq"))),
    ]  # fmt: skip
    rows += peer_rows(section, s, "ws", "floor", floor, "`1+1` over its WebSocket",
                      {"jkg+nd": at_most(0.8)})  # fmt: skip
    p95 = ", ".join(f"{name} {ms(quantile(s.pooled(name), 0.95))}" for name in s.names)
    suite.medians["exec floor"] = s.spread("floor").median
    suite.note(
        section,
        f"{plan.rounds} rounds of {plan.exec_per_round} round trips of each contender, taken"
        f" in turn, the first of the turn rotating from round to round, after {plan.warmup}"
        f" untimed turns ({', '.join(s.names)}). Each cell: median of the round medians"
        " [min–max over rounds]; each ratio: median of the per-round ratios [min–max]."
        " Floors: a stock ipykernel on the host (`floor`), driven by plain jupyter_client"
        " over ipc (`execute`, then wait for the reply and `idle`); and a second one driven"
        " by a minimal client on plain pyzmq (`zmq`: JSON and HMAC only, no `adapt`, no"
        " futures per message). The engine, REST and WebSocket numbers run in a hardened"
        " container. The peers run stock ipykernels as host processes, unsandboxed, behind"
        " tornado (legacy JSON framing), timed to the reply and `idle`: `jkg`/`js` as"
        " shipped (tornado re-enables Nagle after each HTTP response, so small frames wait"
        " for a delayed ACK), `jkg+nd`/`js+nd` with TCP_NODELAY forced on every socket"
        f" (`bench/tornado_nodelay.py`). Pooled p95: {p95}.",
    )
    return rows


async def first_output(suite: Suite) -> list[Row]:
    section = "first output"
    plan = suite.plan
    async with suite.peer_kernels(section, PEERS) as peers:
        s = await interleave(
            {
                "floor": suite.floor.first_print,
                "engine": lambda: engine.first_print(suite.engine_session),
                "ws": lambda: suite.ws.run(FIRST_PRINT, first_stream=True),
                **{key: kernel.first_print for key, kernel in peers.items()},
            },
            rounds=plan.rounds,
            per_round=plan.first_prints,
            warmup=1,
        )
    floor = f"{ms(s.spread('floor').median)} (stock ipykernel, flush)"
    suite.note(
        section,
        f"kernelhub runs `{FIRST_PRINT}`; the floor and the peers run `{FIRST_PRINT_FLUSH}`"
        " (a stock ipykernel sends stdout on a 0.2 s timer unless the cell flushes: that"
        " timer is its choice, not a cost). Time from sending the cell to its first stream"
        " event (engine), frame (WebSocket) or message (floor, peers)."
        f" {plan.rounds} interleaved rounds of {plan.first_prints}, rotating order.",
    )
    rows = [
        Row(section, "`print` → first output, floor: stock ipykernel with `flush=True`",
            spread(s.spread("floor"))),
        Row(section, "`print` → first stream event, engine", spread(s.spread("engine")), floor,
            times(s.ratio("engine", "floor"))),
        Row(section, "`print` → first frame, gateway WebSocket", spread(s.spread("ws")), floor,
            times(s.ratio("ws", "floor")), at_most(1.5, issue="#20"), s.ratio("ws", "floor")),
    ]  # fmt: skip
    return rows + peer_rows(section, s, "ws", "floor", floor, "`print` with flush", {})
