"""Jupyter Server 2.x, started with its gateway client pointed at a real kernelhub gateway,
driven through its own ``/api/kernels`` and channels WebSocket as JupyterLab drives it:
create, execute, a plot's PNG, stdin, interrupt, restart; and an agent's session shown
as a running kernel (``kernelhub.jupyter.server``) that a person can open and watch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kernelhub.jupyter import messages
from tests.conftest import UNIT
from tests.gateway.conftest import Gateway, free_port, wait_until_up
from tests.jupyter.conftest import (
    PLOT,
    Channels,
    agent_run,
    agent_session,
    auth,
    get,
    of_type,
    reply,
    stdout,
)

pytest.importorskip("jupyter_server")
pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]
JTOKEN = "jupyter-server-test-token"


class JupyterServer:
    def __init__(self, gw: Gateway, token: str, home: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.log = home / "jupyter-server.log"
        env = {
            **os.environ,
            "JUPYTER_CONFIG_DIR": str(home / "config"),
            "JUPYTER_DATA_DIR": str(home / "data"),
            "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        }
        args = [
            sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
            f"--ServerApp.root_dir={home}", f"--IdentityProvider.token={JTOKEN}",
            f"--GatewayClient.url={gw.url}", f"--GatewayClient.auth_token={token}",
            "--ServerApp.kernel_manager_class=kernelhub.jupyter.server.KernelhubMappingKernelManager",
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=log)
        wait_until_up(self.proc, f"{self.url}/api", self.log)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def jserver(gw: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterServer]:
    server = JupyterServer(gw, gw.alice, tmp_path_factory.mktemp("jupyter-server"))  # type: ignore[attr-defined]
    yield server
    server.stop()


async def test_jupyter_server_runs_a_sandboxed_kernel_as_lab_does(
    gw: Gateway, jserver: JupyterServer
) -> None:
    alice = gw.alice  # type: ignore[attr-defined]
    async with httpx.AsyncClient(base_url=jserver.url, headers=auth(JTOKEN), timeout=120) as lab:
        specs = (await lab.get("/api/kernelspecs")).json()
        assert specs["default"] == "python3"
        assert "kernelhub" in specs["kernelspecs"]["python3"]["spec"]["metadata"]
        r = await lab.post("/api/kernels", json={"name": "python3"})
        assert r.status_code == 201, r.text
        kernel = r.json()["id"]
        # The kernel is a kernelhub session of the gateway token's principal.
        sessions = (await get(f"{gw.url}/v1/sessions", alice, "Bearer")).json()["sessions"]
        (session,) = [s["id"] for s in sessions if messages.kernel_id(s["id"]) == kernel]
        ch = await Channels.open(
            f"{jserver.ws_url}/api/kernels/{kernel}/channels?token={JTOKEN}&session_id=lab",
            binary=True,
        )
        try:
            assert reply(await ch.request("shell", "kernel_info_request", {}))["status"] == "ok"
            msgs = await ch.execute("x = 6 * 7\nprint('in the sandbox', x)")
            assert stdout(msgs) == "in the sandbox 42\n" and reply(msgs)["status"] == "ok"
            msgs = await ch.execute(PLOT)
            assert any("image/png" in m["content"]["data"] for m in of_type(msgs, "display_data"))

            prompt, msgs = await ch.answer_input("n = input('n? ')\nprint(int(n) + 1)", "41")
            assert prompt == "n? " and "42" in stdout(msgs)

            # Lab's stop button: POST .../interrupt on Jupyter Server, passed to the gateway.
            msg_id = await ch.send(
                "shell",
                "execute_request",
                {"code": "import time\nprint('go', flush=True)\ntime.sleep(60)"},
            )
            await ch.until(msg_id, lambda m: m["header"]["msg_type"] == "stream")
            assert (await lab.post(f"/api/kernels/{kernel}/interrupt")).status_code == 204
            msgs = await ch.until(
                msg_id, lambda m: m["header"]["msg_type"] == "execute_reply", timeout=30
            )
            assert reply(msgs)["ename"] == "KeyboardInterrupt"

            # Restart: variables gone, the same session (and sandbox) kept.
            assert (await lab.post(f"/api/kernels/{kernel}/restart")).status_code == 200
            msgs = await ch.execute("'x' in globals()")
            assert of_type(msgs, "execute_result")[0]["content"]["data"]["text/plain"] == "False"
        finally:
            await ch.close()
        # The cells Lab ran are the session's history, as the agent's would be.
        nb = await get(f"{gw.url}/v1/sessions/{session}/notebook", alice, "Bearer")
        assert "in the sandbox" in nb.text
        assert (await lab.delete(f"/api/kernels/{kernel}")).status_code == 204
        assert (await get(f"{gw.url}/api/kernels/{kernel}", alice)).status_code == 404


async def test_an_agent_session_is_a_running_kernel_to_watch_live(
    gw: Gateway, jserver: JupyterServer
) -> None:
    alice = gw.alice  # type: ignore[attr-defined]
    session = await agent_session(gw, alice)
    kernel = messages.kernel_id(session)
    async with httpx.AsyncClient(base_url=jserver.url, headers=auth(JTOKEN), timeout=60) as lab:
        running = (await lab.get("/api/kernels")).json()
        assert kernel in [k["id"] for k in running]
        ch = await Channels.open(
            f"{jserver.ws_url}/api/kernels/{kernel}/channels?token={JTOKEN}", binary=True
        )
        try:
            await ch.request("shell", "kernel_info_request", {})
            await agent_run(gw, alice, session, "print('the agent works')")
            # The agent's cell arrives on the person's iopub, parented by the execution.
            deadline = time.monotonic() + 30 * UNIT
            text = ""
            while "the agent works" not in text:
                msg = await ch.next(max(deadline - time.monotonic(), 0.1))
                if msg["header"]["msg_type"] == "stream":
                    text += msg["content"]["text"]
        finally:
            await ch.close()
