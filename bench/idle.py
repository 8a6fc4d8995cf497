"""Idle sections: an idle session's memory against a bare ipykernel, and hibernation."""

from __future__ import annotations

import asyncio

import gateway
from floor import FloorKernel
from harness import Suite
from memory import container_pss, container_usage, process_memory
from report import Row, mib, ms, ratio, seconds

from kernelhub.sandbox.base import LABEL_INSTANCE, LABEL_SESSION


async def idle_memory(suite: Suite) -> list[Row]:
    section = "memory"
    bare = await FloorKernel.start(suite.root)
    try:
        await bare.roundtrip()
        sid = await gateway.create_session(suite.http)
        await gateway.rest_roundtrip(suite.http, sid)
        await asyncio.sleep(2)  # idle, and its start-up garbage collected
        rss, pss = process_memory(bare.pid)
        [container] = suite.docker.containers.list(
            filters={"label": [f"{LABEL_SESSION}={sid}", f"{LABEL_INSTANCE}={suite.gw.instance}"]}
        )
        usage, raw = await asyncio.to_thread(container_usage, container)
        sandbox_pss = await asyncio.to_thread(container_pss, container)
        await gateway.delete_session(suite.http, sid)
    finally:
        await bare.stop()
    base = pss or rss
    floor = f"{mib(base)} ({'PSS' if pss else 'RSS'} of a bare ipykernel)"
    suite.note(
        section,
        "One idle session (default limits, one `1+1` run, then 2 s idle) against a stock"
        " ipykernel on the host in the same state. The cgroup number is the docker stats"
        f" API's usage less inactive file cache, as `docker stats` shows it (raw usage"
        f" {mib(raw)}: it counts page cache and tmpfs too). PSS shares libraries fairly"
        f" between processes; the bare kernel's RSS is {mib(rss)}.",
    )
    return [
        Row(section, "idle session: sandbox cgroup memory (as `docker stats`)", mib(usage),
            floor, ratio(usage, base)),
        Row(section, "idle session: PSS of the sandbox's processes (supervisor + kernel)",
            mib(sandbox_pss) if sandbox_pss is not None else "not readable here",
            floor, ratio(sandbox_pss, base) if sandbox_pss is not None else ""),
    ]  # fmt: skip


async def hibernation(suite: Suite) -> list[Row]:
    section = "hibernate"
    gw = await suite.launch_gateway(
        "h", {"KERNELHUB_GATEWAY__HIBERNATE_AFTER": "1", "KERNELHUB_POOL__SIZE": "0"}
    )
    try:
        async with gw.client() as http:
            asleep, woke = await gateway.hibernate_wake(http)
    finally:
        await suite.stop_gateway(gw)
    cold = suite.medians.get("cold gateway")
    suite.note(
        section,
        "A gateway of its own with `KERNELHUB_GATEWAY__HIBERNATE_AFTER=1`; the session"
        " holds an 8 MB numpy array. Hibernation is timed from the end of the cell to the"
        " state `hibernated` (the idle second and the idle check included); waking is the"
        " next execute, end to end (a new sandbox, the restore, the cell). One sample each."
        + (" Floor: the gateway's cold start median from this run." if cold else ""),
    )
    return [
        Row(section, "idle 1 s → hibernated (sandbox removed)", seconds(asleep)),
        Row(section, "wake: first execute after hibernation", seconds(woke),
            f"{ms(cold)} (cold start)" if cold else "", ratio(woke, cold) if cold else ""),
    ]  # fmt: skip
