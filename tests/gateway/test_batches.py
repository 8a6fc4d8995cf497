"""Batch runs end to end: a real gateway, real Docker sessions, one fresh session per item."""

from __future__ import annotations

import asyncio
import base64
import time
from datetime import datetime
from typing import Any

import httpx
import pytest

from kernelhub.client import AsyncHub, BatchInfo, BatchState, ExecutionStatus, batch_item
from tests.conftest import UNIT
from tests.gateway.conftest import Gateway

pytestmark = pytest.mark.docker

# Each item reports what it finds (globals and files left by an earlier item would show)
# and then leaves a trace of its own for a later item to find.
PROBE = """\
import os
print(sorted(k for k in globals() if k.startswith('mark_')), sorted(os.listdir('/workspace')))
mark_{n} = 1
open('/workspace/trace-{n}', 'w').close()
"""
SLEEP = "import time\nfor _ in range(600): time.sleep(1)"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


async def poll(http: httpx.AsyncClient, token: str, batch_id: str, done: Any) -> dict[str, Any]:
    """GET the batch (without results) until ``done(body)``; fail after a generous deadline."""
    deadline = time.monotonic() + 120 * UNIT
    while True:
        r = await http.get(f"/v1/batches/{batch_id}?results=false", headers=auth(token))
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        if done(body):
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.1)


async def test_items_run_in_fresh_sessions_with_their_files_and_results(
    gateway: Gateway,
) -> None:
    token = gateway.token("alice")
    items = [batch_item(PROBE.format(n=n), idempotency_key=f"probe-{n}") for n in range(3)]
    items += [
        batch_item(
            "print(open('data/in.csv').read().strip().split(',')[1])",
            files={"data/in.csv": b"a,b\n", "notes.txt": "hi"},
        ),
        batch_item("1 / 0"),
        batch_item("6 * 7", limits={"memory_bytes": 128 * 2**20}),
    ]
    async with AsyncHub(gateway.url, token, timeout=120 * UNIT) as hub:
        info = await asyncio.wait_for(hub.run_batch(items, concurrency=2), 300 * UNIT)
        assert info.state == BatchState.FINISHED and info.items is not None
        assert info.counts == {"completed": 5, "failed": 1}
        runs = [item.execution for item in info.items]
        assert all(r is not None for r in runs)
        for n in range(3):  # nothing left over from any other item
            assert runs[n] is not None and runs[n].stdout == "[] []\n", runs[n]
        assert runs[3] is not None and runs[3].stdout == "b\n"
        failed = info.items[4]
        assert failed.status == ExecutionStatus.FAILED and failed.error is None  # the cell's
        assert runs[4] is not None and runs[4].error is not None
        assert runs[4].error.name == "ZeroDivisionError"
        assert runs[5] is not None and runs[5].text == "42"
        sessions = {item.session_id for item in info.items}
        assert len(sessions) == 6 and None not in sessions
        spans = [(i.started_at, i.finished_at) for i in info.items]
        assert all(a is not None and b is not None for a, b in spans)
        assert max_overlap(spans) <= 2  # type: ignore[arg-type]
        assert all(i.wait_seconds is not None and i.wait_seconds >= 0 for i in info.items)
        assert await hub.list_sessions() == []  # every item's session was deleted

        # The same keys again: nothing runs; the first items' results come back.
        again = await hub.run_batch(items[:3])
        assert again.items is not None
        for n, item in enumerate(again.items):
            assert item.duplicate_of is not None
            assert (item.duplicate_of.batch_id, item.duplicate_of.index) == (info.id, n)
            assert item.execution_id == info.items[n].execution_id
            assert item.execution is not None and item.execution.stdout == "[] []\n"
        listed = await hub.list_batches()
        assert [b.id for b in listed] == [again.id, info.id] and listed[0].items is None

    async with httpx.AsyncClient(base_url=gateway.url, timeout=30 * UNIT) as http:
        metrics = (await http.get("/metrics", headers=auth(token))).text
    assert 'kernelhub_batch_items_total{status="completed"} 5.0' in metrics
    assert "kernelhub_batch_queue_length 0.0" in metrics
    assert "kernelhub_batch_queue_wait_seconds_count 6.0" in metrics


async def test_capacity_cancel_access_and_bad_requests(make_gateway: Any) -> None:
    gw: Gateway = make_gateway(
        KERNELHUB_BATCH__CONCURRENCY="2",
        KERNELHUB_BATCH__PRINCIPAL_CONCURRENCY="2",
        KERNELHUB_BATCH__MAX_QUEUED_ITEMS="4",
    )
    alice, bob = gw.token("alice"), gw.token("bob")
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        sleepers = {"items": [{"code": SLEEP} for _ in range(4)]}
        r = await http.post("/v1/batches", json=sleepers, headers=auth(alice))
        assert r.status_code == 202, r.text
        first = BatchInfo.model_validate(r.json())
        running = await poll(
            http,
            alice,
            first.id,
            lambda b: sum(1 for i in b["items"] if i["execution_id"]) == 2,
        )
        assert running["state"] == "running" and running["counts"] == {"running": 2, "queued": 2}

        # Two wait; two more would be over the four allowed to wait.
        r = await http.post("/v1/batches", json={"items": [{"code": "1"}] * 3}, headers=auth(alice))
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1 and "MAX_QUEUED_ITEMS" in r.json()["message"]

        # Other principals see nothing.
        for method, path in [
            ("GET", f"/v1/batches/{first.id}"),
            ("POST", f"/v1/batches/{first.id}/cancel"),
        ]:
            r = await http.request(method, path, headers=auth(bob))
            assert r.status_code == 404, (method, path, r.text)
        assert (await http.get("/v1/batches", headers=auth(bob))).json() == {"batches": []}

        # Malformed bodies never queue anything.
        bad: list[tuple[object, int]] = [
            ({"items": []}, 422),
            ({"items": [{"code": "1", "files": {"x": "not base64!"}}]}, 422),
            ({"items": [{"code": "1", "files": {"../x": b64(b"1")}}]}, 422),
            ({"items": [{"code": "1", "surprise": True}]}, 422),
            ({"items": [{"code": "1"}], "concurrency": 3}, 400),
            ({"items": [{"code": "1", "limits": {"pids": 8192}}]}, 400),  # above the max (4096)
            ({"items": [{"code": "1"}] * 5}, 400),  # more than may ever wait
        ]
        for body, status in bad:
            r = await http.post("/v1/batches", json=body, headers=auth(alice))
            assert r.status_code == status, (body, r.text)

        # Cancel: the queued items are cancelled at once, the running ones interrupted.
        r = await http.post(f"/v1/batches/{first.id}/cancel", headers=auth(alice))
        assert r.status_code == 200, r.text
        assert [i["status"] for i in r.json()["items"]][2:] == ["cancelled", "cancelled"]
        done = await poll(http, alice, first.id, lambda b: b["state"] == "cancelled")
        assert done["counts"] == {"interrupted": 2, "cancelled": 2}, done
        full = (await http.get(f"/v1/batches/{first.id}", headers=auth(alice))).json()
        for item in full["items"][:2]:
            assert item["result"]["record"]["ended_by"] == "interrupt", item
            assert "cancelled" in item["error"]
        assert (await http.get("/v1/sessions", headers=auth(alice))).json() == {"sessions": []}
        metrics = (await http.get("/metrics", headers=auth(alice))).text
        assert 'kernelhub_batch_items_total{status="cancelled"} 2.0' in metrics


async def test_one_principals_long_batch_does_not_starve_anothers(make_gateway: Any) -> None:
    # Two slots: by default one principal runs at most one item, and the turns alternate.
    gw: Gateway = make_gateway(KERNELHUB_BATCH__CONCURRENCY="2")
    alice, bob = gw.token("alice"), gw.token("bob")
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        r = await http.post(
            "/v1/batches", json={"items": [{"code": SLEEP}] * 3}, headers=auth(alice)
        )
        assert r.status_code == 202, r.text
        long = r.json()["id"]
        await poll(http, alice, long, lambda b: b["items"][0]["execution_id"] is not None)
        r = await http.post(
            "/v1/batches",
            json={"items": [{"code": f"print({n} * 7)"} for n in range(3)]},
            headers=auth(bob),
        )
        assert r.status_code == 202, r.text
        short = await poll(http, bob, r.json()["id"], lambda b: b["state"] == "finished")
        assert short["counts"] == {"completed": 3}, short
        # Alice's first item still sleeps and her others still wait: her cap held.
        still = (await http.get(f"/v1/batches/{long}?results=false", headers=auth(alice))).json()
        assert still["counts"] == {"running": 1, "queued": 2}, still
        full = (await http.get(f"/v1/batches/{short['id']}", headers=auth(bob))).json()
        printed = [
            "".join(e["text"] for e in i["result"]["events"] if e["type"] == "stream")
            for i in full["items"]
        ]
        assert printed == ["0\n", "7\n", "14\n"]
        await http.post(f"/v1/batches/{long}/cancel", headers=auth(alice))
        await poll(http, alice, long, lambda b: b["state"] == "cancelled")


async def test_a_restart_fails_the_item_that_ran_and_runs_the_waiting_one(
    make_gateway: Any,
) -> None:
    gw: Gateway = make_gateway(KERNELHUB_BATCH__CONCURRENCY="1")
    token = gw.token("alice")
    async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
        body = {
            "items": [
                {"code": SLEEP, "idempotency_key": "slow"},
                {"code": "print('later')", "idempotency_key": "later"},
            ]
        }
        r = await http.post("/v1/batches", json=body, headers=auth(token))
        assert r.status_code == 202, r.text
        batch_id = r.json()["id"]
        await poll(http, token, batch_id, lambda b: b["items"][0]["execution_id"] is not None)
        gw.kill9()
        gw.start()
        # The waiting item's input is in the store: it runs after the restart.
        info = await poll(http, token, batch_id, lambda b: b["state"] == "finished")
        assert info["counts"] == {"failed": 1, "completed": 1}, info
        ran, waited = info["items"]
        assert "while its code ran" in ran["error"] and waited["error"] is None
        full = (await http.get(f"/v1/batches/{batch_id}", headers=auth(token))).json()
        events = full["items"][1]["result"]["events"]
        assert "".join(e["text"] for e in events if e["type"] == "stream") == "later\n"
        # Its session is gone, and both keys stay used: the first item may have run.
        assert (await http.get("/v1/sessions", headers=auth(token))).json() == {"sessions": []}
        r = await http.post("/v1/batches", json=body, headers=auth(token))
        resent = r.json()["items"]
        assert [i["duplicate_of"] for i in resent] == [
            {"batch_id": batch_id, "index": 0},
            {"batch_id": batch_id, "index": 1},
        ]
