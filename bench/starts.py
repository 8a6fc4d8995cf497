"""Start-up sections: a cold session against a bare hardened container running stock
ipykernel, and a burst of twice the warm pool's size against the pool."""

from __future__ import annotations

import asyncio
from typing import Any

import engine
import gateway
from harness import POOL_SIZE, Suite
from report import Row, Unavailable, ms, quantile, seconds, spread, times
from rounds import Spread, interleave
from targets import at_most


async def cold_start(suite: Suite) -> list[Row]:
    section = "cold start"
    plan = suite.plan
    s = await interleave(
        {
            "bare": lambda: asyncio.to_thread(suite.bare.exit_time),
            "bare kernel": suite.bare.kernel_time,
            "engine": lambda: engine.cold_start(suite.backend),
            "gateway": lambda: gateway.cold_start(suite.http),
        },
        rounds=plan.rounds,
        per_round=plan.starts,
        warmup=1,
    )
    suite.medians.update({f"cold {name}": s.spread(name).median for name in s.names})
    floor = f"{ms(s.spread('bare kernel').median)} (bare container + stock ipykernel)"
    suite.note(
        section,
        f"{plan.rounds} interleaved rounds of {plan.starts} of each, rotating order, after"
        " one untimed turn. Floor: the kernel image in a container with kernelhub's exact"
        " hardening (`container_config`: no network, read-only root, all capabilities"
        " dropped, seccomp, limits) running stock ipykernel, from create until it answers"
        " `kernel_info` (plain jupyter_client, polled as fast as the engine polls). Engine:"
        " `KernelSession.start` to a kernel that answers. Gateway: `POST /v1/sessions` to 201"
        " with the pool off. The same container running `python -c pass` to its exit is"
        " shown for scale only. Pooled p90: "
        + ", ".join(f"{k} {ms(quantile(s.pooled(k), 0.9))}" for k in s.names)
        + ".",
    )
    return [
        Row(section, "floor: bare hardened container, stock ipykernel to `kernel_info`",
            spread(s.spread("bare kernel"))),
        Row(section, "engine: create → kernel ready", spread(s.spread("engine")), floor,
            times(s.ratio("engine", "bare kernel"))),
        Row(section, "gateway, no pool: `POST /v1/sessions` → 201", spread(s.spread("gateway")),
            floor, times(s.ratio("gateway", "bare kernel")), at_most(1.05, issue="#20"),
            s.ratio("gateway", "bare kernel")),
        Row(section, "for scale: the same container running `python -c pass`, create → exit",
            spread(s.spread("bare"))),
    ]  # fmt: skip


async def warm_start(suite: Suite) -> list[Row]:
    """Bursts of ``2 × POOL_SIZE`` creates at once from a full pool, while one running
    session keeps executing cells (whose latency shows whether refilling starves it)."""
    section = "warm start"
    burst = 2 * POOL_SIZE
    gw = await suite.launch_gateway("w", {"KERNELHUB_POOL__SIZE": str(POOL_SIZE)})
    p50s: list[float] = []
    p90s: list[float] = []
    ready90s: list[float] = []  # create sent → its first `1+1` answered, p90 per burst
    quiet: list[float] = []  # the running session's cells with the pool full and quiet
    busy: list[float] = []  # ... during a burst and its refill
    warm_count = total = 0
    try:
        async with gw.client() as http:
            sid = await gateway.create_session(http)
            try:
                for _ in range(suite.plan.rounds):
                    await gateway.wait_pool_full(http, POOL_SIZE, timeout=180)
                    for _ in range(5):
                        quiet.append(await gateway.rest_roundtrip(http, sid))
                    done = asyncio.Event()

                    async def cells(done: asyncio.Event) -> None:
                        while not done.is_set():
                            busy.append(await gateway.rest_roundtrip(http, sid))

                    runner = asyncio.create_task(cells(done))

                    async def create_then_run() -> tuple[float, dict[str, Any], float]:
                        t, info = await gateway.create_timed(http)
                        first = await gateway.rest_roundtrip(http, info["id"])
                        return t, info, t + first

                    try:
                        timed = await asyncio.gather(*(create_then_run() for _ in range(burst)))
                        results = [(t, info) for t, info, _ in timed]
                        ready90s.append(quantile([r for _, _, r in timed], 0.9))
                        await gateway.wait_pool_full(http, POOL_SIZE, timeout=180)
                    finally:
                        done.set()
                        await runner
                    for _, info in results:
                        await gateway.delete_session(http, info["id"])
                    latencies = [t for t, _ in results]
                    p50s.append(quantile(latencies, 0.5))
                    p90s.append(quantile(latencies, 0.9))
                    warm_count += sum(info.get("warm") is True for _, info in results)
                    total += len(results)
            finally:
                await gateway.delete_session(http, sid)
    except Unavailable as exc:
        suite.note(section, f"Not measured: {exc}.")
        return [Row(section, f"burst of {burst} from a full pool of {POOL_SIZE}", str(exc))]
    finally:
        await suite.stop_gateway(gw)
    cold = suite.medians.get("cold gateway")
    suite.note(
        section,
        f"A gateway with `KERNELHUB_POOL__SIZE={POOL_SIZE}`. {suite.plan.rounds} bursts: once"
        " `kernelhub_pool_ready` on /metrics says the pool is full, "
        f"{burst} `POST /v1/sessions` (default limits) at once, each timed to its 201; the"
        " burst's p50 and p90 (nearest rank), then the next burst once the pool has refilled."
        f" {warm_count} of {total} answered `warm: true`; the rest answered at once with"
        " `state: starting` (a pool miss does not wait for Docker; its first cell waits for"
        " its kernel), so the row after them times each session from its create to its"
        " first `1+1` answered over REST: the honest cost of a burst. Meanwhile one running session executes `1+1` over REST back to back: its"
        " latency during the bursts and refills against the same with the pool full and quiet"
        " shows whether refilling starves running cells."
        + (f" This run's cold start, for scale: {ms(cold)}." if cold else ""),
    )
    quiet_p90, busy_p90 = quantile(quiet, 0.9), quantile(busy or quiet, 0.9)
    return [
        Row(section, f"burst of {burst} from a full pool of {POOL_SIZE}: p50 per burst",
            spread(Spread.of(p50s), seconds)),
        Row(section, f"burst of {burst} from a full pool of {POOL_SIZE}: p90 per burst",
            spread(Spread.of(p90s), seconds), "", "", at_most(0.1, "s", issue="#20"),
            Spread.of(p90s)),
        Row(section, "the same bursts: create → its first `1+1` answered, p90 per burst",
            spread(Spread.of(ready90s), seconds),
            f"{ms(cold)} (one cold start, for scale)" if cold else ""),
        Row(section, "a running session's `1+1` (REST) during bursts and refill, p90",
            ms(busy_p90), f"{ms(quiet_p90)} (pool full, quiet)", f"{busy_p90 / quiet_p90:.2f}×"),
    ]  # fmt: skip
