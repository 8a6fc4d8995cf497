"""The warm pool end to end: a real gateway keeping real Docker sandboxes ready."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import RUN_INSTANCE, UNIT
from tests.gateway.conftest import Gateway
from tests.gateway.test_gateway import _run_dir, auth, run, stdout

pytestmark = pytest.mark.docker

LABEL_INSTANCE = f"org.kernelhub.instance={RUN_INSTANCE}-p"


def _containers() -> dict[str, str]:
    """Container id -> session label, of this test's gateway."""
    client = docker.from_env()
    try:
        found = client.containers.list(all=True, filters={"label": LABEL_INSTANCE})
        return {c.id: c.labels["org.kernelhub.session"] for c in found}
    finally:
        client.close()


async def _pool_ready(http: httpx.AsyncClient, want: int) -> None:
    for _ in range(int(600 * UNIT)):
        text = (await http.get("/metrics")).text
        match = re.search(r"^kernelhub_pool_ready (\S+)$", text, re.M)
        assert match, text
        if float(match.group(1)) >= want:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the pool never reached {want} ready sandboxes")


@pytest.fixture
def pooled(tmp_path: Path) -> Any:
    gw = Gateway(
        tmp_path / "data",
        _run_dir(),
        KERNELHUB_POOL__SIZE="2",
        KERNELHUB_GATEWAY__INSTANCE=f"{RUN_INSTANCE}-p",
    )
    gw.start()
    yield gw
    gw.stop()
    client = docker.from_env()
    for container in client.containers.list(all=True, filters={"label": LABEL_INSTANCE}):
        container.remove(force=True)
    client.close()


async def test_sessions_take_warm_sandboxes_that_are_never_reused(pooled: Gateway) -> None:
    token = pooled.token("alice")
    h = auth(token)
    async with httpx.AsyncClient(base_url=pooled.url, timeout=120 * UNIT, headers=h) as http:
        await _pool_ready(http, 2)
        pooled_ids = _containers()
        assert len(pooled_ids) == 2

        r = await http.post("/v1/sessions", json={}, headers=h)
        assert r.status_code == 201, r.text
        first = r.json()
        assert first["warm"] is True and first["state"] == "ready"
        # The session is one of the sandboxes that were waiting, under its labelled id.
        assert first["id"] in pooled_ids.values()
        await run(http, token, first["id"], "secret = 'alice'; open('a.txt', 'w').write('a')")

        await _pool_ready(http, 2)  # refilled in the background
        after = _containers()
        assert len(after) == 3 and set(pooled_ids) < set(after)

        r = await http.post("/v1/sessions", json={}, headers=h)
        second = r.json()
        assert second["warm"] is True and second["id"] != first["id"]
        result = await run(
            http, token, second["id"], "import os; print('secret' in dir(), os.listdir('.'))"
        )
        assert stdout(result) == "False []\n"

        # Deleting a session removes its sandbox; it never goes back to the pool.
        assert (await http.delete(f"/v1/sessions/{first['id']}", headers=h)).status_code == 204
        await _pool_ready(http, 2)
        left = _containers()
        assert first["id"] not in left.values()
        assert list(left.values()).count(second["id"]) == 1

        # Other limits than the pool's: a cold start, not a pooled sandbox.
        r = await http.post("/v1/sessions", json={"limits": {"pids": 100}}, headers=h)
        assert r.status_code == 201 and r.json()["warm"] is False
        metrics = (await http.get("/metrics")).text
        assert 'kernelhub_pool_takes_total{result="hit"} 2.0' in metrics


def _started(tmp_path: Path, **env: str) -> Gateway:
    gw = Gateway(
        tmp_path / "data", _run_dir(), KERNELHUB_GATEWAY__INSTANCE=f"{RUN_INSTANCE}-p", **env
    )
    gw.start()
    return gw


def _client(gw: Gateway, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT, headers=auth(token))


def _remove_sandboxes() -> None:
    client = docker.from_env()
    for container in client.containers.list(all=True, filters={"label": LABEL_INSTANCE}):
        container.remove(force=True)
    client.close()


async def _info(http: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    r = await http.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_a_burst_past_the_pool_answers_at_once_and_its_cells_wait_for_the_kernel(
    tmp_path: Path,
) -> None:
    gw = _started(tmp_path, KERNELHUB_POOL__SIZE="1")
    try:
        token = gw.token("bob")
        async with _client(gw, token) as http:
            await _pool_ready(http, 1)
            answers = await asyncio.gather(
                *(http.post("/v1/sessions", json={}, headers=auth(token)) for _ in range(3))
            )
            assert all(r.status_code == 201 for r in answers), [r.text for r in answers]
            infos = sorted((r.json() for r in answers), key=lambda i: not i["warm"])
            # One took the pooled sandbox; the others did not wait for Docker: they are
            # starting, and say so.
            assert [(i["warm"], i["state"]) for i in infos] == [
                (True, "ready"), (False, "starting"), (False, "starting"),
            ]  # fmt: skip
            warm, cold, dropped = (i["id"] for i in infos)
            # Deleted while its sandbox was still starting: the sandbox goes when it is up.
            assert (await http.delete(f"/v1/sessions/{dropped}")).status_code == 204
            # A cell on a starting session waits for its kernel, then runs.
            for sid in (warm, cold):
                assert stdout(await run(http, token, sid, "print(6 * 7)")) == "42\n"
            # (busy: its checkpoint after the cell may still be running)
            assert (await _info(http, cold))["state"] in {"ready", "busy"}
            for _ in range(int(600 * UNIT)):
                if dropped not in _containers().values():
                    break
                await asyncio.sleep(0.1)
            assert dropped not in _containers().values()
            # The emergency stop takes the pool's sandboxes down too.
            admin = gw.token("root", admin=True)
            await _pool_ready(http, 1)
            r = await http.post("/v1/admin/stop-all", headers=auth(admin))
            assert r.status_code == 200
        gw.stop()
        # A stopping gateway removes its pooled sandboxes (nobody re-adopts them).
        assert _containers() == {}
    finally:
        gw.stop()
        _remove_sandboxes()


async def test_a_profile_has_a_pool_of_its_own_with_its_limits(tmp_path: Path) -> None:
    small = 256 * 1024 * 1024
    gw = _started(
        tmp_path,
        KERNELHUB_POOL__SIZE="0",
        KERNELHUB_POOL__PROFILES=json.dumps({"small": 1}),
        KERNELHUB_POOL__MISS="wait",
        KERNELHUB_PROFILES__TIERS=json.dumps({"small": {"limits": {"memory_bytes": small}}}),
    )
    try:
        token = gw.token("carol")
        async with _client(gw, token) as http:
            await _pool_ready(http, 1)
            pooled = set(_containers().values())
            r = await http.post("/v1/sessions", json={"profile": "small"})
            assert r.status_code == 201, r.text
            info = r.json()
            assert info["warm"] is True and info["id"] in pooled
            assert info["limits"]["memory_bytes"] == small
            client = docker.from_env()
            try:
                (container,) = client.containers.list(
                    filters={"label": f"org.kernelhub.session={info['id']}"}
                )
                assert container.attrs["HostConfig"]["Memory"] == small
            finally:
                client.close()
            assert stdout(await run(http, token, info["id"], "print('small')")) == "small\n"
            # The default limits have no pool here; with KERNELHUB_POOL__MISS=wait a miss
            # answers once its sandbox is up, as with no pool at all.
            r = await http.post("/v1/sessions", json={})
            assert r.status_code == 201 and (r.json()["warm"], r.json()["state"]) == (
                False, "ready",
            )  # fmt: skip
    finally:
        gw.stop()
        _remove_sandboxes()
