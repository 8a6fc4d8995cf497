"""A cell that changes nothing a checkpoint keeps costs no capture (the kernel says so in
its execute_reply: ``kernelhub_unchanged_since``), and rewind, recovery and images that
never say so still work; over a real gateway and real Docker sandboxes."""

from __future__ import annotations

import uuid

import httpx

from tests.conftest import UNIT
from tests.gateway.conftest import Gateway
from tests.gateway.test_durable import SEGFAULT, checkpointed, pytestmark, ready_again
from tests.gateway.test_gateway import auth, new_session, run, stdout

__all__ = ["pytestmark"]

# Changes nothing a checkpoint keeps (the comprehension's name is gone after it).
LIST_CHECKPOINTS = (
    "print(len([d for d in __import__('os').listdir(__import__('os').environ.get("
    "'KERNELHUB_SNAPSHOTS', '/tmp/.kernelhub')) if d.startswith('ckpt-')]))"
)


async def captures(http: httpx.AsyncClient, token: str, sid: str) -> int:
    return int(stdout(await run(http, token, sid, LIST_CHECKPOINTS)))


async def test_a_cell_that_changes_nothing_is_not_captured_and_rewind_before_it_works(
    shared_gateway: Gateway,
) -> None:
    token = shared_gateway.token(f"una-{uuid.uuid4().hex[:6]}")
    async with httpx.AsyncClient(base_url=shared_gateway.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, token)
        await run(http, token, sid, "x = [1]")
        await checkpointed(http, token, sid, 1)
        assert stdout(await run(http, token, sid, "print(len(x) + 1)")) == "2\n"
        await checkpointed(http, token, sid, 2)  # covered at once, by the same capture
        assert await captures(http, token, sid) == 1  # cell 3, itself unchanged
        await run(http, token, sid, "x.append(2)")  # mutates a kept object
        await checkpointed(http, token, sid, 4)
        assert await captures(http, token, sid) == 2
        r = await http.post(
            f"/v1/sessions/{sid}/rewind", json={"before_cell": 3}, headers=auth(token)
        )
        assert r.status_code == 200, r.text
        assert r.json()["checkpoint_after_cell"] == 2, r.json()
        again = await run(http, token, sid, "print(x)")
        assert again["record"]["execution_count"] == 3, again["record"]
        assert stdout(again) == "[1]\n"
        await http.delete(f"/v1/sessions/{sid}", headers=auth(token))


async def test_a_kernel_that_never_reports_unchanged_gets_a_capture_after_every_cell(
    shared_gateway: Gateway,
) -> None:
    token = shared_gateway.token(f"old-{uuid.uuid4().hex[:6]}")
    async with httpx.AsyncClient(base_url=shared_gateway.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, token)
        # Read when the first capture installs the kernel's hooks: as an old image.
        await run(
            http, token, sid, "import os\nos.environ['KERNELHUB_KERNEL_REPORT_UNCHANGED'] = '0'"
        )
        await checkpointed(http, token, sid, 1)
        await run(http, token, sid, "1 + 1")
        await checkpointed(http, token, sid, 2)
        assert await captures(http, token, sid) == 2
        await checkpointed(http, token, sid, 3)
        r = await http.post(
            f"/v1/sessions/{sid}/rewind", json={"before_cell": 3}, headers=auth(token)
        )
        assert r.status_code == 200, r.text
        again = await run(
            http, token, sid, "print(os.environ['KERNELHUB_KERNEL_REPORT_UNCHANGED'])"
        )
        assert again["record"]["execution_count"] == 3, again["record"]
        await http.delete(f"/v1/sessions/{sid}", headers=auth(token))


async def test_a_kernel_death_after_an_unchanged_cell_recovers_its_state(
    shared_gateway: Gateway,
) -> None:
    token = shared_gateway.token(f"die-{uuid.uuid4().hex[:6]}")
    async with httpx.AsyncClient(base_url=shared_gateway.url, timeout=120 * UNIT) as http:
        sid = await new_session(http, token)
        await run(http, token, sid, "x = 41")
        await checkpointed(http, token, sid, 1)
        await run(http, token, sid, "y = x + 1")
        await checkpointed(http, token, sid, 2)
        quiet = await run(http, token, sid, "print(y)")
        await checkpointed(http, token, sid, 3)
        died = await run(http, token, sid, SEGFAULT, timeout=60)
        assert died["status"] == "kernel_died", died["record"]
        recovery = (await ready_again(http, token, sid))["recovery"]
        assert recovery["checkpoint_after_cell"] == 3, recovery
        assert recovery["lost"] == [died["id"]] and quiet["id"] not in recovery["lost"], recovery
        after = await run(http, token, sid, "print(x, y)")
        assert stdout(after) == "41 42\n", after
        await http.delete(f"/v1/sessions/{sid}", headers=auth(token))
