"""The Jupyter kernels API (/api) and the E2B API, through the real app (its lifespan, a
real SqliteStore in a temporary data directory, the local backend, which starts nothing
here). Session rows are written before the gateway starts: alice's hibernated one (held,
with no sandbox: listed, never woken by these requests) and dead one, and bob's; no
request reaches a kernel."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from kernelhub import __version__
from kernelhub.gateway.e2b import PREFIX as E2B
from kernelhub.jupyter.messages import KERNEL_NAME, kernel_id
from kernelhub.store.sqlite import SqliteStore
from tests.unit.gateway.app_rig import Gateway, row, serve


async def _seed(store: SqliteStore) -> dict[str, str]:
    tokens = {
        "alice": await store.create_token("alice"),
        "bob": await store.create_token("bob"),
        "reader": await store.create_token("alice-ro", read_only=True, acts_for="alice"),
    }
    await store.insert_session(row("sleepy", "alice", {"team": "red"}))
    await store.update_session("sleepy", state="hibernated", hibernation="snap-none")
    await store.insert_session(row("dead1", "alice", {"team": "red"}))
    await store.update_session("dead1", state="dead", reason="oom")
    for sid in ("sleepy2", "sleepy3", "sleepy4"):  # for the tests that end one
        await store.insert_session(row(sid, "alice", {"team": "blue"}))
        await store.update_session(sid, state="hibernated", hibernation=f"snap-{sid}")
    await store.insert_session(row("bobs1", "bob", {}))
    await store.update_session("bobs1", state="hibernated", hibernation="snap-none2")
    return tokens


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from serve(tmp_path_factory, _seed)


# -- Jupyter ------------------------------------------------------------------------------


def test_the_version_probe_needs_no_token(gateway: Gateway) -> None:
    client, _ = gateway
    assert client.get("/api").json() == {"version": __version__, "implementation": "kernelhub"}


@pytest.mark.parametrize("how", ["token", "Bearer", "query"])
def test_jupyter_clients_send_their_token_three_ways(gateway: Gateway, how: str) -> None:
    client, tokens = gateway
    t = tokens["alice"]
    if how == "query":
        r = client.get("/api/kernelspecs", params={"token": t})
    else:
        r = client.get("/api/kernelspecs", headers={"Authorization": f"{how} {t}"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["default"] == KERNEL_NAME
    spec = body["kernelspecs"][KERNEL_NAME]["spec"]
    assert spec["language"] == "python"
    assert spec["metadata"]["kernelhub"]["backend"] == "local"


def test_jupyter_refusals_say_how_to_send_the_token(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    r = client.get("/api/kernels")
    assert r.status_code == 401
    assert "Authorization: token" in r.json()["message"]
    scoped = client.get("/api/kernels", headers={"Authorization": f"token {tokens['reader']}"})
    assert scoped.status_code == 403
    assert "Jupyter kernels API" in scoped.json()["message"]


def _jh(token: str) -> dict[str, str]:
    return {"Authorization": f"token {token}"}


def test_a_kernelspec_by_name(gateway: Gateway) -> None:
    client, tokens = gateway
    ok = client.get(f"/api/kernelspecs/{KERNEL_NAME}", headers=_jh(tokens["alice"]))
    assert ok.json()["name"] == KERNEL_NAME
    r = client.get("/api/kernelspecs/julia", headers=_jh(tokens["alice"]))
    assert r.status_code == 404 and "'julia'" in r.json()["message"]
    start = client.post("/api/kernels", headers=_jh(tokens["alice"]), json={"name": "julia"})
    assert start.status_code == 404 and "'julia'" in start.json()["message"]


def test_kernels_are_the_callers_live_sessions(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    kernels = client.get("/api/kernels", headers=_jh(tokens["alice"])).json()
    ids = [k["kernelhub"]["session_id"] for k in kernels]
    assert "sleepy" in ids and "dead1" not in ids
    (k,) = [k for k in kernels if k["kernelhub"]["session_id"] == "sleepy"]
    assert k["id"] == kernel_id("sleepy")
    assert (k["name"], k["execution_state"], k["connections"]) == (KERNEL_NAME, "idle", 0)
    assert k["kernelhub"]["state"] == "hibernated"
    one = client.get(f"/api/kernels/{k['id']}", headers=_jh(tokens["alice"]))
    assert one.status_code == 200 and one.json()["id"] == k["id"]
    bobs = [
        k["kernelhub"]["session_id"]
        for k in client.get("/api/kernels", headers=_jh(tokens["bob"])).json()
    ]
    assert bobs == ["bobs1"]


@pytest.mark.parametrize(
    ("method", "suffix"),
    [("GET", ""), ("DELETE", ""), ("POST", "/interrupt"), ("POST", "/restart")],
)
@pytest.mark.parametrize("kernel", [kernel_id("dead1"), kernel_id("bobs1"), "not-a-kernel"])
def test_ended_foreign_or_unknown_kernels_are_not_found(
    gateway: Gateway, method: str, suffix: str, kernel: str
) -> None:
    client, tokens = gateway
    r = client.request(method, f"/api/kernels/{kernel}{suffix}", headers=_jh(tokens["alice"]))
    assert r.status_code == 404, r.text
    assert kernel in r.json()["message"]


# -- E2B ----------------------------------------------------------------------------------


def _key(token: str) -> dict[str, str]:
    return {"X-API-Key": token}


def test_e2b_refusals_are_in_e2bs_shape(gateway: Gateway) -> None:
    client, tokens = gateway
    r = client.get(E2B + "/sandboxes")
    assert r.status_code == 401
    assert r.json()["code"] == 401 and "E2B_API_KEY" in r.json()["message"]
    scoped = client.get(E2B + "/v2/sandboxes", headers=_key(tokens["reader"]))
    assert scoped.status_code == 403 and scoped.json()["code"] == 403
    env = client.post(
        E2B + "/sandboxes", headers=_key(tokens["alice"]), json={"envVars": {"A": "1"}}
    )
    assert env.status_code == 400 and "environment variables" in env.json()["message"]


def test_sandboxes_list_the_callers_live_sessions_by_state_and_metadata(
    gateway: Gateway,
) -> None:
    client, tokens = gateway

    def ids(**params: str) -> list[str]:
        r = client.get(E2B + "/v2/sandboxes", headers=_key(tokens["alice"]), params=params)
        assert r.status_code == 200, r.text
        return [s["sandboxID"] for s in r.json()]

    assert "sleepy" in ids() and "dead1" not in ids()
    assert ids(metadata="team=red") == ["sleepy"]
    assert "sleepy" not in ids(metadata="team=blue")
    assert ids(state="paused") == []  # hibernated reads as running to E2B
    (record,) = [
        s
        for s in client.get(
            E2B + "/sandboxes", headers={"Authorization": f"Bearer {tokens['alice']}"}
        ).json()
        if s["sandboxID"] == "sleepy"
    ]
    assert record["metadata"] == {"team": "red"}
    assert record["templateID"] == "kernelhub"  # not made through E2B: no template of its own


@pytest.mark.parametrize("sandbox", ["dead1", "bobs1", "nope"])
def test_ended_foreign_or_unknown_sandboxes_are_not_found(gateway: Gateway, sandbox: str) -> None:
    client, tokens = gateway
    h = _key(tokens["alice"])
    for method, path, body in [
        ("GET", f"{E2B}/sandboxes/{sandbox}", None),
        ("POST", f"{E2B}/sandboxes/{sandbox}/connect", {"timeout": 60}),
        ("POST", f"{E2B}/sandboxes/{sandbox}/timeout", {"timeout": 60}),
        ("DELETE", f"{E2B}/sandboxes/{sandbox}", None),
    ]:
        r = client.request(method, path, headers=h, json=body)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["code"] == 404
    # The sandbox plane: E2B's proxy answers 502 for a gone sandbox (is_running() False).
    health = client.get(E2B + "/health", headers={**h, "E2b-Sandbox-Id": sandbox})
    assert health.status_code == 502


def test_sandbox_plane_requests_name_their_sandbox(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    r = client.get(E2B + "/health", headers={"X-Access-Token": tokens["alice"]})
    assert r.status_code == 400 and "E2b-Sandbox-Id" in r.json()["message"]
    ok = client.get(
        E2B + "/health", headers={"X-Access-Token": tokens["alice"], "E2b-Sandbox-Id": "sleepy"}
    )
    assert ok.status_code == 204


def test_contexts_and_cells_are_python_only(gateway: Gateway) -> None:
    client, tokens = gateway
    h = {"E2b-Traffic-Access-Token": tokens["alice"], "E2b-Sandbox-Id": "sleepy"}
    ctx = client.post(E2B + "/contexts", headers=h, json={})
    assert ctx.json() == {"id": "default", "language": "python", "cwd": "/workspace"}
    for body, status, needle in [
        ({"language": "r"}, 400, "Python only"),
    ]:
        r = client.post(E2B + "/contexts", headers=h, json=body)
        assert (r.status_code, needle in r.json()["message"]) == (status, True)
    for body, status, needle in [
        ({"code": "1", "language": "js"}, 400, "Python only"),
        ({"code": "1", "context_id": "other"}, 404, "'other'"),
        ({"code": "1", "env_vars": {"A": "1"}}, 400, "environment variables"),
    ]:
        r = client.post(E2B + "/execute", headers=h, json=body)
        assert r.status_code == status, r.text
        assert needle in r.json()["message"]


def test_timeouts_past_e2bs_maximum_are_refused(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    r = client.post(
        E2B + "/sandboxes/sleepy/timeout", headers=_key(tokens["alice"]), json={"timeout": 10**9}
    )
    assert r.status_code == 422


def test_deleting_a_kernel_ends_its_session(gateway: Gateway) -> None:
    client, tokens = gateway
    kid = kernel_id("sleepy2")
    assert client.delete(f"/api/kernels/{kid}", headers=_jh(tokens["bob"])).status_code == 404
    r = client.delete(f"/api/kernels/{kid}", headers=_jh(tokens["alice"]))
    assert r.status_code == 204, r.text
    assert client.get(f"/api/kernels/{kid}", headers=_jh(tokens["alice"])).status_code == 404
    gone = client.get(
        "/v1/sessions/sleepy2", headers={"Authorization": f"Bearer {tokens['alice']}"}
    )
    assert (gone.status_code, gone.json()["error"]) == (410, "session_ended")


def test_killing_a_sandbox_ends_its_session(gateway: Gateway) -> None:
    client, tokens = gateway
    h = _key(tokens["alice"])
    assert client.delete(f"{E2B}/sandboxes/sleepy3", headers=_key(tokens["bob"])).status_code == 404
    assert client.delete(f"{E2B}/sandboxes/sleepy3", headers=h).status_code == 204
    assert client.get(f"{E2B}/sandboxes/sleepy3", headers=h).status_code == 404
    listed = [s["sandboxID"] for s in client.get(f"{E2B}/sandboxes", headers=h).json()]
    assert "sleepy3" not in listed


def test_connect_extends_and_a_passed_timeout_ends_the_sandbox(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    h = _key(tokens["alice"])

    def end_at() -> datetime:
        r = client.get(f"{E2B}/sandboxes/sleepy4", headers=h)
        assert r.status_code == 200, r.text
        return datetime.fromisoformat(r.json()["endAt"].replace("Z", "+00:00"))

    assert client.post(f"{E2B}/sandboxes/sleepy4/timeout", headers=h, json={"timeout": 3600})
    far = end_at()
    assert far > datetime.now(UTC) + timedelta(minutes=50)
    # Connecting with a shorter timeout never shortens the lifetime; a longer one extends it.
    client.post(f"{E2B}/sandboxes/sleepy4/connect", headers=h, json={"timeout": 60})
    assert end_at() == far
    client.post(f"{E2B}/sandboxes/sleepy4/connect", headers=h, json={"timeout": 7200})
    assert end_at() > far
    # A timeout of 0: the deadline is now, so the next look finds it ended (and deletes it).
    r = client.post(f"{E2B}/sandboxes/sleepy4/timeout", headers=h, json={"timeout": 0})
    assert r.status_code == 204
    assert client.get(f"{E2B}/sandboxes/sleepy4", headers=h).status_code == 404
    state = client.get(
        "/v1/sessions/sleepy4", headers={"Authorization": f"Bearer {tokens['alice']}"}
    )
    assert (state.status_code, state.json()["error"]) == (410, "session_ended")


@pytest.mark.parametrize("rpc", ["ListDir", "Stat"])
def test_filesystem_rpcs_answer_connect_errors(gateway: Gateway, rpc: str) -> None:
    client, tokens = gateway
    h = {"X-Access-Token": tokens["alice"], "E2b-Sandbox-Id": "dead1"}
    r = client.post(f"{E2B}/filesystem.Filesystem/{rpc}", headers=h, json={"path": "/"})
    assert r.status_code == 404
    assert r.json()["code"] == "not_found" and "dead1" in r.json()["message"]
    unnamed = client.post(
        f"{E2B}/filesystem.Filesystem/{rpc}", headers={"X-Access-Token": tokens["alice"]}, json={}
    )
    assert unnamed.status_code == 400 and unnamed.json()["code"] == "invalid_argument"


def test_the_session_gauges_count_held_sessions_by_state(gateway: Gateway) -> None:
    client, tokens = gateway
    want: dict[str, int] = {}
    for who in ("alice", "bob"):
        h = {"Authorization": f"Bearer {tokens[who]}"}
        for s in client.get("/v1/sessions", headers=h).json()["sessions"]:
            if s["state"] != "deleted":
                want[s["state"]] = want.get(s["state"], 0) + 1
    assert want.get("hibernated") and want.get("dead")  # the seeded rows are held
    text = client.get("/metrics", headers={"Authorization": f"Bearer {tokens['alice']}"}).text
    got = {
        line.split('"')[1]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kernelhub_sessions{")
    }
    assert "deleted" not in got  # never held, never a series
    assert {k: v for k, v in got.items() if v} == want
