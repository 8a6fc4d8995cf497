"""Snapshots streamed out of the sandbox, end to end through a real gateway: a namespace
bigger than the sandbox's /tmp snapshots and restores with default limits, and one over
the gateway's cap is a typed 413 naming the knob (never a 500)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import UNIT
from tests.gateway import test_gateway
from tests.gateway.conftest import Gateway
from tests.gateway.test_gateway import auth, new_session, run, stdout

pytestmark = pytest.mark.docker
http = test_gateway.http  # the fixture: a client of the test's gateway

MiB = 2**20


async def test_a_300_mib_namespace_snapshots_and_restores_with_default_limits(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    h = auth(token)
    sid = await new_session(http, token)  # default limits: 512 MiB memory, 128 MiB /tmp
    made = await run(
        http, token, sid,
        "import numpy as np\n"
        "rng = np.random.default_rng(7)\n"
        "parts = [rng.random(100 * 2**20 // 8) for _ in range(3)]\n"
        "labels = {'run': 7, 'names': ['a', 'b']}\n"
        "import hashlib\n"
        "print([hashlib.md5(memoryview(p)).hexdigest() for p in parts])",
    )  # fmt: skip
    assert made["status"] == "completed", made
    total = stdout(made).strip()
    r = await http.post(f"/v1/sessions/{sid}/snapshots", headers=h)
    assert r.status_code == 201, r.text
    snap = r.json()
    assert {"parts", "labels"} <= set(snap["saved"]) and snap["size_bytes"] > 300 * MiB
    blob = Path(gateway.env["KERNELHUB_DATA_DIR"]) / "snapshots" / f"{snap['id']}.blob"
    assert blob.stat().st_size == snap["size_bytes"]
    r = await http.post("/v1/sessions", json={"from_snapshot": snap["id"]}, headers=h)
    assert r.status_code == 201, r.text
    restored = r.json()
    assert restored["restore"]["failed"] == {}, restored["restore"]
    check = await run(
        http, token, restored["id"],
        "import hashlib\n"
        "print([hashlib.md5(memoryview(p)).hexdigest() for p in parts])\n"
        "print(labels['names'])",
    )  # fmt: skip
    assert stdout(check) == f"{total}\n['a', 'b']\n", check


async def test_a_snapshot_over_the_cap_is_a_413_naming_the_knob(
    make_gateway: Any, tmp_path: Path
) -> None:
    gateway = make_gateway(KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES=str(16 * MiB))
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as client:
        token = gateway.token("alice")
        sid = await new_session(client, token)
        await run(client, token, sid, "import numpy as np\nbig = np.ones(40 * 2**20 // 8)")
        r = await client.post(f"/v1/sessions/{sid}/snapshots", headers=auth(token))
        assert r.status_code == 413, r.text
        assert "KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES" in r.json()["message"]
        assert not list((Path(gateway.env["KERNELHUB_DATA_DIR"]) / "snapshots").glob("*.blob"))
        after = await run(client, token, sid, "print(big.size)")
        assert stdout(after) == f"{40 * 2**20 // 8}\n"


async def test_unpicklables_are_rebuilt_through_the_api(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    """A sqlite3 connection to a file database, a compiled regex's match and a generator
    not started come back after a snapshot and restore; what cannot is named."""
    token = gateway.token("alice")
    h = auth(token)
    sid = await new_session(http, token)
    for cell in [
        "import sqlite3, re\n"
        "with sqlite3.connect('notes.db') as setup:\n"
        "    setup.execute('create table t(x)')\n    setup.execute('insert into t values (7)')",
        "conn = sqlite3.connect('notes.db')",
        "pattern = re.compile(r'(\\w+)@(\\w+)')\nfound = pattern.search('mail bob@example now')",
        "squares = (i * i for i in range(5))",
        "spent = iter(range(3))\nnext(spent)",
        "tape = (i for i in range(3))",
        "next(tape)",
    ]:
        assert (await run(http, token, sid, cell))["status"] == "completed", cell
    r = await http.post(f"/v1/sessions/{sid}/snapshots", headers=h)
    assert r.status_code == 201, r.text
    r = await http.post("/v1/sessions", json={"from_snapshot": r.json()["id"]}, headers=h)
    assert r.status_code == 201, r.text
    report = r.json()["restore"]
    assert {"conn", "found", "squares"} <= set(report["restored"]), report
    check = await run(
        http, token, r.json()["id"],
        "print(conn.execute('select x from t').fetchall(), found.groups(), list(squares))",
    )  # fmt: skip
    assert stdout(check) == "[(7,)] ('bob', 'example') [0, 1, 4, 9, 16]\n", check
    lost = {**report["skipped"], **report["failed"]}
    assert "setup" in lost and "effects outside the session" in lost["setup"]
    assert "changed it after it was made" in lost["tape"]
    assert all("re-run the code that made it" in lost[n] for n in ("setup", "tape"))
