"""Durable by default (issue 19): a session's state outlives its kernel's death, with
default options, over a real gateway and real Docker sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.conftest import UNIT, eventually
from tests.gateway.conftest import Gateway
from tests.gateway.test_gateway import auth, new_session, run, stdout

pytestmark = pytest.mark.docker

IMAGE_ENV = (
    {"KERNELHUB_DOCKER__IMAGE": os.environ["KERNELHUB_DOCKER__IMAGE"]}
    if "KERNELHUB_DOCKER__IMAGE" in os.environ
    else {}
)
OOM = "blocks = []\nwhile True:\n    blocks.append(bytearray(32 * 2**20))"
SEGFAULT = "import ctypes\nctypes.string_at(0)"


async def ready_again(http: httpx.AsyncClient, token: str, sid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60 * UNIT
    while True:
        info = (await http.get(f"/v1/sessions/{sid}", headers=auth(token))).json()
        if info["state"] == "ready" and info["recovery"] is not None:
            return dict(info)
        assert info["state"] in ("recovering", "ready", "busy"), info
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.05)


async def checkpointed(http: httpx.AsyncClient, token: str, sid: str, cell: int) -> None:
    """Wait until the session's latest checkpoint is the one after ``cell``."""
    deadline = time.monotonic() + 30 * UNIT
    while True:
        info = (await http.get(f"/v1/sessions/{sid}", headers=auth(token))).json()
        if info["checkpoint_after_cell"] == cell:
            return
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.01)


async def notice_saying(gateway: Gateway, token: str, sid: str, text: str) -> str:
    """The first notice on the session's stream (replayed from the start) that says
    ``text``, waiting for it up to 60 s."""
    url = f"{gateway.ws_url}/v1/sessions/{sid}/stream?since=0"
    async with connect(url, additional_headers=auth(token)) as ws:
        deadline = time.monotonic() + 60 * UNIT
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no notice saying {text!r}"
            frame = json.loads(await asyncio.wait_for(ws.recv(), left))
            event = frame.get("event") or {}
            if event.get("type") == "notice" and text in event["message"]:
                return str(event["message"])


async def notices(gateway: Gateway, token: str, sid: str, until_seq: int) -> list[str]:
    url = f"{gateway.ws_url}/v1/sessions/{sid}/stream?since=0"
    found = []
    async with connect(url, additional_headers=auth(token)) as ws:
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
            if frame["type"] != "event":
                continue
            if frame["event"]["type"] == "notice":
                found.append(frame["event"]["message"])
            if frame["event"]["seq"] >= until_seq:
                return found


@pytest.mark.parametrize(
    ("crash", "reason"), [(OOM, "out of memory"), (SEGFAULT, "SIGSEGV")], ids=["oom", "segfault"]
)
async def test_a_kernel_death_under_default_options_keeps_the_state(
    shared_gateway: Gateway, crash: str, reason: str
) -> None:
    gateway = shared_gateway
    token = gateway.token(f"alice-{uuid.uuid4().hex[:6]}")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
        # Default options, a small memory limit so the OOM comes quickly.
        sid = await new_session(http, token, limits={"memory_bytes": 256 * 2**20})
        await run(http, token, sid, "import pandas as pd\ndf = pd.DataFrame({'v': range(5)})")
        await run(http, token, sid, "df['w'] = df['v'] * 2\nstep = 2")
        died = await run(http, token, sid, crash, timeout=60)
        assert died["status"] == "kernel_died", died["record"]
        assert reason in died["record"]["reason"], died["record"]
        info = await ready_again(http, token, sid)
        recovery = info["recovery"]
        assert recovery["checkpoint_after_cell"] == 2, recovery
        assert died["id"] in recovery["lost"] and reason in recovery["reason"], recovery
        after = await run(http, token, sid, "print(list(df['w']), step)")
        assert after["status"] == "completed", after["record"]
        assert stdout(after) == "[0, 2, 4, 6, 8] 2\n"
        said = await notices(gateway, token, sid, after["events"][-1]["seq"])
        recovered = [n for n in said if "recovered" in n]
        assert recovered and reason in recovered[0] and died["id"] in recovered[0], said
        await http.delete(f"/v1/sessions/{sid}", headers=auth(token))


async def test_a_session_without_checkpoints_restarts_empty_and_says_so(
    shared_gateway: Gateway,
) -> None:
    gateway = shared_gateway
    token = gateway.token(f"bob-{uuid.uuid4().hex[:6]}")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, token, checkpoints="off")
        await run(http, token, sid, "x = 41\nopen('kept.txt', 'w').write('file')")
        died = await run(http, token, sid, "import os\nos._exit(3)")
        assert died["status"] == "kernel_died", died["record"]
        info = await ready_again(http, token, sid)
        assert info["recovery"]["checkpoint_after_cell"] is None, info["recovery"]
        assert "restarted empty" in info["recovery"]["message"]
        # Not `409 session is dead`: the next cell runs, in an empty kernel and workspace.
        after = await run(http, token, sid, "import os\nprint('x' in globals(), os.listdir())")
        assert stdout(after) == "False []\n", after
        said = await notices(gateway, token, sid, after["events"][-1]["seq"])
        assert any("restarted empty" in n for n in said), said
        await http.delete(f"/v1/sessions/{sid}", headers=auth(token))


COUNT_FOR_8_S = "import time\nfor i in range(80):\n    print(i, flush=True)\n    time.sleep(0.1)"


async def test_a_gateway_killed_mid_cell_loses_no_output_and_records_the_true_outcome(
    make_gateway: Callable[..., Gateway],
) -> None:
    gateway = make_gateway(**IMAGE_ENV)
    token = gateway.token("alice")
    h = auth(token)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, token)
        r = await http.post(
            f"/v1/sessions/{sid}/executions", json={"code": COUNT_FOR_8_S}, headers=h
        )
        eid = r.json()["id"]
        # Killed once the cell has printed a few lines (and the gateway stored them).
        url = f"{gateway.ws_url}/v1/sessions/{sid}/stream?since=0"
        async with connect(url, additional_headers=h) as ws:
            seen = ""
            while seen.count("\n") < 5:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 30 * UNIT))
                if frame["type"] == "event" and frame["event"]["type"] == "stream":
                    seen += frame["event"]["text"]
    gateway.kill9()
    gateway.start()  # about 2 s: the cell keeps printing meanwhile, to no one
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
        deadline = time.monotonic() + 60 * UNIT
        while True:
            execution = (await http.get(f"/v1/executions/{eid}", headers=h)).json()
            if execution["record"] is not None:
                break
            assert time.monotonic() < deadline, execution
            await asyncio.sleep(0.1)
        record = execution["record"]
        assert execution["status"] == "completed", record
        assert record["ended_by"] == "reply" and record["dropped_bytes"] == 0, record
        # The full numbered transcript: no gap, no duplicate, seqs in order.
        assert stdout(execution) == "".join(f"{i}\n" for i in range(80)), stdout(execution)
        seqs = [e["seq"] for e in execution["events"]]
        assert seqs == sorted(set(seqs)), seqs
        # The stream replays the same, and the session works on.
        after = await run(http, token, sid, "print(i)")
        assert stdout(after) == "79\n"
        assert min(e["seq"] for e in after["events"]) > max(seqs)


async def test_rewind_to_before_any_cell_with_default_options(shared_gateway: Gateway) -> None:
    gateway = shared_gateway
    token = gateway.token(f"carol-{uuid.uuid4().hex[:6]}")
    h = auth(token)

    def cell(i: int) -> str:  # cell i prints the steps before it, then adds its own
        return f"print(globals().get('steps'))\nsteps = (globals().get('steps') or []) + [{i}]"

    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, token)
        for i in range(1, 6):
            assert stdout(await run(http, token, sid, cell(i))).startswith(("None", "["))
        for before in (5, 2, 4, 1, 3):
            r = await http.post(
                f"/v1/sessions/{sid}/rewind", json={"before_cell": before}, headers=h
            )
            assert r.status_code == 200, r.text
            # The next cell is cell `before` again, and sees the state from before it.
            again = await run(http, token, sid, cell(before))
            assert again["record"]["execution_count"] == before, again["record"]
            expected = None if before == 1 else list(range(1, before))
            assert stdout(again) == f"{expected}\n", (before, r.json(), stdout(again))
            for i in range(before + 1, 6):  # the future again, for the next rewind
                await run(http, token, sid, cell(i))
        await http.delete(f"/v1/sessions/{sid}", headers=h)


async def test_a_hibernated_session_wakes_from_its_standby_sandbox_with_its_state(
    make_gateway: Callable[..., Gateway],
) -> None:
    gateway = make_gateway(KERNELHUB_GATEWAY__HIBERNATE_AFTER=str(2 * UNIT), **IMAGE_ENV)
    token = gateway.token("dave")
    h = auth(token)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, token)
        state = "import numpy as np\nbig = np.arange(100 * 2**20 // 8, dtype='float64')"
        await run(http, token, sid, state)  # cell 1: 100 MiB
        await run(http, token, sid, "small = {'n': 1}")  # cell 2
        deadline = time.monotonic() + 60 * UNIT
        while (await http.get(f"/v1/sessions/{sid}", headers=h)).json()["state"] != "hibernated":
            assert time.monotonic() < deadline, "never hibernated"
            await asyncio.sleep(0.1)
        # Its standby sandbox comes up meanwhile (an agent's next call comes much later).
        ready = f"session {sid}: standby sandbox ready"
        await eventually(lambda: ready in gateway.log.read_text(), 60, interval=0.1)
        t0 = time.monotonic()
        woke = await run(
            http, token, sid, "print(float(big.sum()) == float(np.arange(big.size).sum()), small)"
        )
        elapsed = time.monotonic() - t0
        assert stdout(woke) == "True {'n': 1}\n", woke
        log = gateway.log.read_text()
        line = next(x for x in log.splitlines() if f"session {sid} woke in" in x)
        assert "on standby in 0.00 s, restored from the kept capture" in line, line
        print(f"wake + cell: {elapsed:.2f} s; {line.split('woke in', 1)[1]}")
        # Its checkpoints came along: rewind still reaches the cells before hibernation.
        r = await http.post(f"/v1/sessions/{sid}/rewind", json={"before_cell": 2}, headers=h)
        assert r.status_code == 200, r.text
        after = await run(http, token, sid, "print('small' in globals(), big.size)")
        assert stdout(after) == f"False {100 * 2**20 // 8}\n", after


async def test_a_checkpoint_that_stalls_turns_checkpoints_off_and_says_so(
    make_gateway: Callable[..., Gateway],
) -> None:
    deadline = 3 * UNIT
    gateway = make_gateway(KERNELHUB_GATEWAY__CHECKPOINT_TIMEOUT=str(deadline), **IMAGE_ENV)
    token = gateway.token("erin")
    stall = (
        "import time\nclass Stall:\n    def __reduce__(self):\n        time.sleep(3600)\n"
        "        return (Stall, ())\nstall = Stall()\nx = 41"
    )
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, token)
        await run(http, token, sid, stall)
        t0 = time.monotonic()
        after = await run(http, token, sid, "print(x + 1)")  # waits out one checkpoint at most
        assert stdout(after) == "42\n", after
        assert time.monotonic() - t0 < deadline + 20 * UNIT
        # The stalled checkpoint (taken once the session is idle) is stopped at its deadline.
        said = await notice_saying(gateway, token, sid, "checkpoints are off for this session")
        assert f"ran past {deadline:g} s" in said, said
        t1 = time.monotonic()
        again = await run(http, token, sid, "print(x + 2)")
        assert stdout(again) == "43\n"
        await run(http, token, sid, "print(x + 3)")  # no checkpoint in the way now
        assert time.monotonic() - t1 < deadline, "a checkpoint still stalled the cells"


async def test_cells_sent_back_to_back_never_wait_for_a_checkpoint_and_a_burst_gets_one(
    make_gateway: Callable[..., Gateway],
) -> None:
    # Each checkpoint of `slow` takes a second (its pickling sleeps; every cell touches it,
    # so every checkpoint pickles it again). A grace longer than the gaps between these
    # REST calls makes the five cells one burst, whatever this machine's speed.
    gateway = make_gateway(KERNELHUB_GATEWAY__CHECKPOINT_GRACE=str(2 * UNIT), **IMAGE_ENV)
    token = gateway.token(f"fred-{uuid.uuid4().hex[:6]}")
    h = auth(token)
    slow = (
        "import time\nclass Slow:\n    n = 0\n    def __reduce__(self):\n"
        "        time.sleep(1)\n        return (Slow, ())\nslow = Slow()"
    )
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, token)
        await run(http, token, sid, slow)  # cell 1
        await checkpointed(http, token, sid, 1)
        t0 = time.monotonic()
        ids = [(await run(http, token, sid, f"slow.n = {i}"))["id"] for i in range(2, 7)]
        took = time.monotonic() - t0
        # Before, each cell waited for the checkpoint of the one before it: >= 4 s.
        assert took < 2 * UNIT, f"five cells took {took:.2f} s"
        info = (await http.get(f"/v1/sessions/{sid}", headers=h)).json()
        assert info["checkpoint_after_cell"] == 1, info  # the burst is not in one yet
        # A crash now comes back to the checkpoint before the burst and names its cells.
        died = await run(http, token, sid, "import os\nos._exit(3)")
        recovery = (await ready_again(http, token, sid))["recovery"]
        assert recovery["checkpoint_after_cell"] == 1, recovery
        assert recovery["lost"] == [*ids, died["id"]], recovery
        # Once idle, the burst gets one checkpoint, after its last cell.
        await run(http, token, sid, "slow.n = 7")
        await run(http, token, sid, "slow.n = 8")
        t1 = time.monotonic()
        await checkpointed(http, token, sid, 3)  # execution counts restart with the kernel
        assert time.monotonic() - t1 >= 1.0  # it did pickle `slow`, once
        r = await http.post(f"/v1/sessions/{sid}/rewind", json={"before_cell": 3}, headers=h)
        assert r.status_code == 200, r.text
        assert r.json()["checkpoint_after_cell"] == 1, r.json()
        after = await run(http, token, sid, "print(slow.n if hasattr(slow, 'n') else None)")
        said = await notices(gateway, token, sid, after["events"][-1]["seq"])
        assert any("cell 2 ran back to back with cell 3" in n for n in said), said
        await http.delete(f"/v1/sessions/{sid}", headers=h)
