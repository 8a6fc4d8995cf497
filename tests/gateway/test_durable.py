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

from tests.conftest import UNIT
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
        assert info["state"] in ("starting", "ready", "busy"), info
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.05)


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
