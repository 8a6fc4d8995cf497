"""Hibernation under a hostile neighbour: a real gateway and real Docker sandboxes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import docker
import httpx
import pytest

from tests.conftest import UNIT, eventually
from tests.gateway.conftest import Gateway
from tests.gateway.test_gateway import auth, new_session, run, stdout

pytestmark = pytest.mark.docker

# Pickling `stall` sleeps for an hour: far past any deadline the test could wait out.
STALL = """\
import time
class Stall:
    def __reduce__(self):
        time.sleep(3600)
        return (Stall, ())
stall = Stall()
x = 41
"""


def container_ids(session_id: str) -> set[str]:
    client = docker.from_env()
    try:
        label = f"org.kernelhub.session={session_id}"
        return {c.id for c in client.containers.list(all=True, filters={"label": label})}
    finally:
        client.close()


def containers(session_id: str) -> int:
    return len(container_ids(session_id))


async def test_a_session_that_stalls_pickling_does_not_hold_up_the_others(
    make_gateway: Callable[..., Gateway],
) -> None:
    deadline = 15 * UNIT  # the stalled session's; the calm one must not wait it out
    gw = make_gateway(
        KERNELHUB_GATEWAY__HIBERNATE_AFTER=str(2 * UNIT),
        KERNELHUB_GATEWAY__HIBERNATE_TIMEOUT=str(deadline),
    )
    token = gw.token("alice")
    h = auth(token)
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        # No checkpoints: one would stall too (then turn itself off) before hibernation.
        stalled = await new_session(http, token, checkpoints="off")
        await run(http, token, stalled, STALL)  # idle first: its hibernation starts first
        calm = await new_session(http, token)
        await run(http, token, calm, "y = 2")
        awake = container_ids(calm)
        t0 = time.monotonic()
        while (await http.get(f"/v1/sessions/{calm}", headers=h)).json()["state"] != ("hibernated"):
            assert time.monotonic() - t0 < deadline, "the calm session waited its turn"
            await asyncio.sleep(0.1)
        # Its sandbox is gone (a fresh, empty standby one may be starting for the wake).
        assert not awake & container_ids(calm) and containers(calm) <= 1
        # The stalled one stays awake in its own sandbox; once its deadline passed and the
        # capture was interrupted, a cell finds its variables as they were.
        state = (await http.get(f"/v1/sessions/{stalled}", headers=h)).json()["state"]
        assert state in ("ready", "busy"), state  # busy: the capture is still stalled
        after = await run(http, token, stalled, "print(x + 1, type(stall).__name__)")
        assert stdout(after) == "42 Stall\n", (after["record"], after["events"])
        assert time.monotonic() - t0 < deadline + 30 * UNIT
        assert containers(stalled) == 1
        state = (await http.get(f"/v1/sessions/{stalled}", headers=h)).json()["state"]
        assert state in ("ready", "busy"), state
        woke = await run(http, token, calm, "print(y * 21)")
        assert stdout(woke) == "42\n"
    # Logged once the capture's leftovers are removed too, after the cell that waited.
    warning = f"could not hibernate session {stalled}: its hibernation snapshot ran past"
    await eventually(lambda: warning in gw.log.read_text(), 10, interval=0.1)
    assert "KERNELHUB_GATEWAY__HIBERNATE_TIMEOUT" in gw.log.read_text()


async def test_a_cell_sent_during_the_capture_is_not_lost_to_hibernation(
    make_gateway: Callable[..., Gateway],
) -> None:
    gw = make_gateway(KERNELHUB_GATEWAY__HIBERNATE_AFTER=str(2 * UNIT))
    token = gw.token("alice")
    h = auth(token)
    slow = STALL.replace("3600", str(4 * UNIT)).replace("x = 41", "n = 1")  # a slow capture
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        # No checkpoints: each would be a slow capture too, and look like the hibernation.
        sid = await new_session(http, token, checkpoints="off")
        await run(http, token, sid, slow)

        async def state() -> str:
            return str((await http.get(f"/v1/sessions/{sid}", headers=h)).json()["state"])

        t0 = time.monotonic()
        seen = [await state()]
        while seen[-1] != "busy":  # nothing of ours runs: that is the capture
            assert time.monotonic() - t0 < 30 * UNIT, f"no hibernation started: {seen}"
            await asyncio.sleep(0.05)
            if (now := await state()) != seen[-1]:
                seen.append(now)
        during = await run(http, token, sid, "n += 1\nprint(n)")
        assert stdout(during) == "2\n"
        t0 = time.monotonic()
        while await state() != "hibernated":  # the next try, once idle again
            assert time.monotonic() - t0 < 60 * UNIT, "never hibernated"
            await asyncio.sleep(0.1)
        woke = await run(http, token, sid, "print(n)")
        assert stdout(woke) == "2\n"  # not the state from before the cell
    assert f"session {sid} was used while hibernating" in gw.log.read_text()
