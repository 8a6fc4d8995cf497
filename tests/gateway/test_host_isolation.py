"""What a sandbox may not do to the host, end to end: fill the host's disk through the
directories it shares with it, break their cleanup, keep its resources after dying,
shadow the program the host runs inside it; and what two gateways on one host may not do
to each other. Real gateways, real Docker sandboxes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import RUN_INSTANCE, UNIT
from tests.gateway.conftest import Gateway
from tests.gateway.test_gateway import _run_dir, auth, new_session, run, stdout

pytestmark = pytest.mark.docker
IMAGE_ENV = (
    {"KERNELHUB_DOCKER__IMAGE": os.environ["KERNELHUB_DOCKER__IMAGE"]}
    if "KERNELHUB_DOCKER__IMAGE" in os.environ
    else {}
)


@pytest.fixture
async def http(gateway: Gateway) -> Any:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as client:
        yield client


def session_root(gateway: Gateway, sid: str) -> Path:
    return Path(gateway.env["KERNELHUB_RUN_DIR"]) / gateway.env["KERNELHUB_GATEWAY__INSTANCE"] / sid


def containers_of(sid: str) -> list[Any]:
    client = docker.from_env()
    try:
        return list(
            client.containers.list(all=True, filters={"label": f"org.kernelhub.session={sid}"})
        )
    finally:
        client.close()


async def poll(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout * UNIT
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout * UNIT:g} s"
        await asyncio.sleep(0.05)


FILL = """
import errno, os
written, err = 0, None
try:
    with open({path!r}, "wb") as f:
        chunk = b"x" * 2**20
        for _ in range(50):
            f.write(chunk); f.flush(); written += len(chunk)
except OSError as e:
    err = errno.errorcode.get(e.errno)
print(written, err)
"""

DEEP = """
import os
fd = os.open({path!r}, os.O_RDONLY | os.O_DIRECTORY)
made = 0
try:
    for _ in range(3000):
        os.mkdir("d\\n..", dir_fd=fd)
        nxt = os.open("d\\n..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd); fd = nxt; made += 1
    os.symlink("/", "root-link", dir_fd=fd)
except OSError as e:
    pass
print(made)
"""


async def test_the_socket_directory_holds_no_data_and_any_tree_is_cleaned_up(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    root = session_root(gateway, sid)
    state = root.with_name(f"{sid}.state")
    assert os.path.ismount(root / "ipc"), "the socket directory is not its own tmpfs"
    written, err = stdout(
        await run(http, token, sid, FILL.format(path="/run/kernelhub/ipc/x"))
    ).split()
    written_bytes = int(written)
    assert err in ("ENOSPC", "EACCES"), (written, err)
    assert written_bytes <= 2**20, f"{written_bytes} bytes written into the host's socket directory"
    # The host's side: nothing beyond the cap landed on its disk.
    assert (root / "ipc" / "x").stat().st_size <= 2**20
    # A 3,000-deep tree with odd names and a link to / in the state directory (on the
    # host), and as deep as the inode cap lets it in the socket directory.
    made = stdout(await run(http, token, sid, DEEP.format(path="/tmp/.kernelhub")))
    assert int(made) == 3000
    stdout(await run(http, token, sid, DEEP.format(path="/run/kernelhub/ipc")))
    r = await http.delete(f"/v1/sessions/{sid}", headers=auth(token))
    assert r.status_code == 204, r.text
    assert not root.exists() and not state.exists()
    assert Path("/").is_dir() and Path("/etc/passwd").is_file()


async def test_an_oom_killed_session_releases_everything_at_once_and_can_be_deleted(
    make_gateway: Callable[..., Gateway],
) -> None:
    # Dead: with recovery on (the default) the gateway would bring the session back.
    gateway = make_gateway(KERNELHUB_GATEWAY__RECOVER_CRASHED="false", **IMAGE_ENV)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120 * UNIT) as http:
        await _oom_killed_session_releases_everything(gateway, http)


async def _oom_killed_session_releases_everything(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token, limits={"memory_bytes": 128 * 2**20})
    root = session_root(gateway, sid)
    state = root.with_name(f"{sid}.state")
    assert containers_of(sid) and os.path.ismount(state)
    r = await http.post(
        f"/v1/sessions/{sid}/executions",
        json={"code": "x = b'\\x01' * 2**30", "wait": True},
        headers=auth(token),
    )
    assert r.status_code == 200, r.text

    async def state_of() -> str:
        return str((await http.get(f"/v1/sessions/{sid}", headers=auth(token))).json()["state"])

    deadline = time.monotonic() + 30 * UNIT
    while await state_of() != "dead":
        assert time.monotonic() < deadline, "the session never became dead"
        await asyncio.sleep(0.05)
    # Container, socket directory, state tmpfs: gone without anyone deleting the session.
    await poll(lambda: not containers_of(sid) and not root.exists() and not state.exists(), 10)
    info = (await http.get(f"/v1/sessions/{sid}", headers=auth(token))).json()
    assert "memory" in (info["reason"] or ""), info
    # DELETE works on it, once.
    sid2 = await new_session(http, token)
    assert (await http.delete(f"/v1/sessions/{sid}", headers=auth(token))).status_code == 204
    assert (
        await http.delete(f"/v1/sessions/{sid}", headers=auth(token))
    ).status_code == 410  # gone: it was yours
    # And `sessions rm` on one that was dead already when the gateway (re)started.
    gateway.kill9()
    for c in containers_of(sid2):  # it dies while no gateway watches
        c.kill()
    gateway.start()  # finds it dead
    gateway.kill9()
    gateway.start()  # knows it only from the store
    info = (await http.get(f"/v1/sessions/{sid2}", headers=auth(token))).json()
    assert info["state"] == "dead", info
    env = {**gateway.env, "KERNELHUB_URL": gateway.url, "KERNELHUB_TOKEN": token}
    out = subprocess.run(
        [sys.executable, "-m", "kernelhub.cli", "sessions", "rm", sid2],
        env=env, capture_output=True, text=True, timeout=60 * UNIT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    gone = await http.get(f"/v1/sessions/{sid2}", headers=auth(token))
    assert gone.status_code == 410 and gone.json()["error"] == "session_ended", gone.text


async def test_dead_sessions_count_against_the_principal_quota(tmp_path: Path) -> None:
    gw = Gateway(
        tmp_path / "data",
        _run_dir(),
        KERNELHUB_GATEWAY__MAX_SESSIONS_PER_PRINCIPAL="1",
        KERNELHUB_GATEWAY__RECOVER_CRASHED="false",  # a kernel that dies ends its session
        **IMAGE_ENV,
    )
    gw.start()
    try:
        token = gw.token("alice")
        async with httpx.AsyncClient(base_url=gw.url, timeout=120 * UNIT) as http:
            sid = await new_session(http, token)
            for c in containers_of(sid):
                c.kill()
            deadline = time.monotonic() + 30 * UNIT
            while (await http.get(f"/v1/sessions/{sid}", headers=auth(token))).json()[
                "state"
            ] != "dead":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            r = await http.post("/v1/sessions", json={}, headers=auth(token))
            assert r.status_code == 429 and "dead" in r.json()["message"], r.text
            # Still counted by a gateway that finds it dead when it starts.
            gw.kill9()
            gw.start()
            r = await http.post("/v1/sessions", json={}, headers=auth(token))
            assert r.status_code == 429 and "1 of them dead" in r.json()["message"], r.text
            assert (
                await http.delete(f"/v1/sessions/{sid}", headers=auth(token))
            ).status_code == 204
            await new_session(http, token)
    finally:
        gw.stop()


async def test_the_files_program_cannot_be_shadowed_and_paths_are_checked(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    h = auth(token)
    plant = """
import os
os.makedirs("/workspace/kernelhub_kernel", exist_ok=True)
lie = "import sys\\nsys.stdout.buffer.write(b'PLANTED' * 1000); sys.exit(0)\\n"
for name in ("__init__.py", "files.py", "__main__.py"):
    open(f"/workspace/kernelhub_kernel/{name}", "w").write(lie)
for name in ("os.py", "stat.py", "errno.py", "tarfile.py", "sitecustomize.py"):
    open(f"/workspace/{name}", "w").write(lie)
open("/workspace/real.txt", "w").write("real content")
os.mkfifo("/workspace/pipe")
print("planted")
"""
    assert stdout(await run(http, token, sid, plant)) == "planted\n"
    r = await http.get(f"/v1/sessions/{sid}/files/real.txt", headers=h)
    assert r.status_code == 200 and r.content == b"real content", r.content[:100]
    # A FIFO: refused at once, not after the stall of a blocked open.
    t0 = time.monotonic()
    r = await http.get(f"/v1/sessions/{sid}/files/pipe", headers=h)
    assert r.status_code == 400 and "regular file" in r.json()["message"], r.text
    r = await http.put(f"/v1/sessions/{sid}/files/pipe", content=b"x", headers=h)
    assert r.status_code == 400, r.text
    assert time.monotonic() - t0 < 10 * UNIT
    for bad in ["a%00b", "%2500", "a/%00", "..%2Fetc%2Fpasswd", "x/../../y", "%2Fetc%2Fpasswd",
                "a" * 300, "/".join(["d"] * 600), "tab%09name", "%0A"]:  # fmt: skip
        for method in ("GET", "PUT"):
            r = await http.request(
                method, f"/v1/sessions/{sid}/files/{bad}", headers=h, content=b"x"
            )
            assert 400 <= r.status_code < 500, (method, bad, r.status_code, r.text[:200])
            assert r.json()["message"] and "Traceback" not in r.text, r.text


async def test_a_second_serve_on_the_same_data_dir_refuses_before_touching_anything(
    tmp_path: Path,
) -> None:
    first = Gateway(tmp_path / "data", _run_dir(), KERNELHUB_POOL__SIZE="1", **IMAGE_ENV)
    first.start()
    try:
        token = first.token("alice")
        async with httpx.AsyncClient(base_url=first.url, timeout=120 * UNIT) as http:
            sid = await new_session(http, token)
            instance = first.env["KERNELHUB_GATEWAY__INSTANCE"]
            label = {"label": f"org.kernelhub.instance={instance}"}
            client = docker.from_env()
            await poll(lambda: len(client.containers.list(filters=label)) == 2, 60)
            before = sorted(c.id for c in client.containers.list(filters=label))
            second = Gateway(tmp_path / "data", _run_dir(), **IMAGE_ENV)
            t0 = time.monotonic()
            out = subprocess.run(
                [sys.executable, "-m", "kernelhub.cli", "serve"],
                env=second.env, capture_output=True, text=True, timeout=60 * UNIT,
            )  # fmt: skip
            assert out.returncode == 1, out
            assert f"pid {first.proc.pid if first.proc else '?'}" in out.stderr, out.stderr
            assert "KERNELHUB_DATA_DIR" in out.stderr and "ready" not in out.stdout + out.stderr
            assert time.monotonic() - t0 < 30 * UNIT
            # The first gateway's session and pooled sandbox are untouched.
            assert sorted(c.id for c in client.containers.list(filters=label)) == before
            client.close()
            assert stdout(await run(http, token, sid, "print('still here')")) == "still here\n"
            # `reap` refuses too: it would take the live sandboxes for orphans.
            out = subprocess.run(
                [sys.executable, "-m", "kernelhub.cli", "reap"],
                env=second.env, capture_output=True, text=True, timeout=60 * UNIT,
            )  # fmt: skip
            assert out.returncode == 1 and "in use" in out.stderr, out
    finally:
        first.stop()


async def test_gateways_on_one_host_never_reap_each_other(tmp_path: Path) -> None:
    """Different instances, and the same instance with different data directories: each
    restart reaps, and no one loses a session."""
    run_dir = _run_dir()
    a = Gateway(tmp_path / "a", run_dir, **IMAGE_ENV)
    b = Gateway(
        tmp_path / "b", run_dir, KERNELHUB_GATEWAY__INSTANCE=f"{RUN_INSTANCE}-h", **IMAGE_ENV
    )
    c = Gateway(tmp_path / "c", run_dir, **IMAGE_ENV)  # a's instance name, its own data dir
    a.start()
    b.start()
    try:
        ta, tb = a.token("alice"), b.token("alice")
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=120 * UNIT) as ha,
            httpx.AsyncClient(base_url=b.url, timeout=120 * UNIT) as hb,
        ):
            sa = await new_session(ha, ta)
            sb = await new_session(hb, tb)
            await run(ha, ta, sa, "x = 'a'")
            await run(hb, tb, sb, "x = 'b'")
            b.kill9()
            b.start()  # reaps its instance at start
            c.start()  # same instance as a, another data dir: reaps too
            tc = c.token("carol")
            async with httpx.AsyncClient(base_url=c.url, timeout=120 * UNIT) as hc:
                sc = await new_session(hc, tc)
                assert stdout(await run(hc, tc, sc, "print(1)")) == "1\n"
            c.kill9()
            a.kill9()
            a.start()  # a's restart re-adopts its session, and c's is not its orphan
            assert stdout(await run(ha, ta, sa, "print(x)")) == "a\n"
            assert stdout(await run(hb, tb, sb, "print(x)")) == "b\n"
            assert [ctr.status for ctr in containers_of(sc)] == ["running"], "a reaped c's"
            assert session_root(c, sc).is_dir()
    finally:
        for gw in (a, b, c):
            gw.stop()
        client = docker.from_env()
        for instance in (f"{RUN_INSTANCE}-g", f"{RUN_INSTANCE}-h"):
            for ctr in client.containers.list(
                all=True, filters={"label": f"org.kernelhub.instance={instance}"}
            ):
                ctr.remove(force=True)
        client.close()
