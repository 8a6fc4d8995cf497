"""The gateway's Jupyter kernels API against real sandboxes: the channels WebSocket in both
framings, auth as Jupyter clients send it, isolation between principals, nbclient and
jupyter_client through kernelhub's kernel manager, and one history shared with the agent."""

from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest
import websockets
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager, start_new_kernel
from jupyter_client.provisioning import KernelProvisionerFactory
from nbclient import NotebookClient

from kernelhub.client import errors as client_errors
from kernelhub.jupyter import messages
from kernelhub.jupyter.provisioner import (
    PROVISIONER_NAME,
    KernelhubKernelManager,
    KernelhubProvisioner,
)
from tests.conftest import UNIT
from tests.gateway.conftest import Gateway
from tests.jupyter.conftest import (
    PLOT,
    Channels,
    agent_run,
    agent_session,
    auth,
    channels_url,
    get,
    of_type,
    reply,
    stdout,
)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "v1"])
async def test_channels_run_cells_with_plots_stdin_and_interrupt(gw: Gateway, binary: bool) -> None:
    alice = gw.alice  # type: ignore[attr-defined]
    async with httpx.AsyncClient(base_url=gw.url, headers=auth(alice), timeout=120) as http:
        r = await http.post("/api/kernels", json={"name": "python3"})
        assert r.status_code == 201, r.text
        kernel = r.json()["id"]
        assert str(uuid.UUID(kernel)) == kernel  # Jupyter Server's routes take UUIDs only
        ch = await Channels.open(channels_url(gw, kernel, alice), binary=binary)
        assert ch.binary == binary  # the gateway takes the v1 subprotocol when offered
        try:
            info = reply(await ch.request("shell", "kernel_info_request", {}))
            assert info["status"] == "ok" and info["language_info"]["name"] == "python"

            msgs = await ch.execute("x = 20\nprint('x is', x)\nx + 1")
            assert stdout(msgs) == "x is 20\n"
            (result,) = of_type(msgs, "execute_result")
            assert result["content"]["data"]["text/plain"] == "21"
            assert reply(msgs)["status"] == "ok"
            assert [m["content"]["execution_state"] for m in of_type(msgs, "status")] == [
                "busy",
                "idle",
            ]

            msgs = await ch.execute(PLOT)
            (png,) = [
                m for m in of_type(msgs, "display_data") if "image/png" in m["content"]["data"]
            ]
            assert len(png["content"]["data"]["image/png"]) > 1000

            msgs = await ch.execute("1/0")
            err = reply(msgs)
            assert err["status"] == "error" and err["ename"] == "ZeroDivisionError"

            # stdin: the kernel's input() becomes an input_request; the reply answers it.
            prompt, msgs = await ch.answer_input("name = input('who? ')\nprint('hi', name)", "Ada")
            assert prompt == "who? "
            assert "hi Ada" in stdout(msgs) and reply(msgs)["status"] == "ok"
            # The confirm helper asks the same way.
            prompt, msgs = await ch.answer_input("print('go' if confirm('delete?') else 'no')", "y")
            assert prompt == "delete? [y/N] " and stdout(msgs) == "go\n"

            # interrupt_request on control stops the cell; the kernel keeps its variables.
            msg_id = await ch.send(
                "shell",
                "execute_request",
                {"code": "import time\nprint('go', flush=True)\ntime.sleep(60)"},
            )
            await ch.until(msg_id, lambda m: m["header"]["msg_type"] == "stream")
            interrupted = await ch.request("control", "interrupt_request", {})
            assert reply(interrupted)["status"] == "ok"
            msgs = await ch.until(
                msg_id, lambda m: m["header"]["msg_type"] == "execute_reply", timeout=30
            )
            assert reply(msgs)["ename"] == "KeyboardInterrupt"
            assert (
                of_type(await ch.execute("x"), "execute_result")[0]["content"]["data"]["text/plain"]
                == "20"
            )

            complete = reply(
                await ch.request("shell", "is_complete_request", {"code": "for i in x:"})
            )
            assert complete["status"] == "incomplete"
            # Completion and inspection ask the (idle) kernel itself.
            code = "y = len\nprint(x.bit_"
            done = reply(
                await ch.request(
                    "shell", "complete_request", {"code": code, "cursor_pos": len(code)}
                )
            )
            assert "bit_length" in done["matches"] or "x.bit_length" in done["matches"], done
            assert done["cursor_end"] == len(code)
            seen = reply(
                await ch.request("shell", "inspect_request", {"code": "len", "cursor_pos": 3})
            )
            assert seen["found"] and "text/plain" in seen["data"]
        finally:
            await ch.close()
        assert (await http.delete(f"/api/kernels/{kernel}")).status_code == 204
        assert (await http.get(f"/api/kernels/{kernel}")).status_code == 404


async def test_auth_as_jupyter_sends_it_and_other_principals_get_404(gw: Gateway) -> None:
    alice, bob = gw.alice, gw.bob  # type: ignore[attr-defined]
    session = await agent_session(gw, alice)
    kernel = messages.kernel_id(session)
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
        for headers, params in (
            (auth(alice, "token"), {}),
            (auth(alice, "Bearer"), {}),
            ({}, {"token": alice}),
        ):
            r = await http.get(f"/api/kernels/{kernel}", headers=headers, params=params)
            assert r.status_code == 200, r.text
            assert r.json()["kernelhub"]["session_id"] == session
        assert (await http.get("/api/kernels")).status_code == 401
        assert (await http.get("/api/kernels", headers=auth("kh_not-a-token"))).status_code == 401
        # Every existing session of the caller is a kernel; nobody else's is.
        mine = (await http.get("/api/kernels", headers=auth(alice))).json()
        assert kernel in [k["id"] for k in mine]
        theirs = (await http.get("/api/kernels", headers=auth(bob))).json()
        assert kernel not in [k["id"] for k in theirs]
        # Someone else's kernel answers exactly as one that never existed.
        never = str(uuid.uuid4())
        for kid in (kernel, never, "not-a-uuid"):
            for method, path in (
                ("GET", f"/api/kernels/{kid}"),
                ("DELETE", f"/api/kernels/{kid}"),
                ("POST", f"/api/kernels/{kid}/interrupt"),
                ("POST", f"/api/kernels/{kid}/restart"),
            ):
                r = await http.request(method, path, headers=auth(bob))
                assert r.status_code == 404, (method, path, r.text)
                assert "not yours" in r.json()["message"]
        spec = (await http.get("/api/kernelspecs", headers=auth(bob))).json()
        assert (
            spec["kernelspecs"]["python3"]["spec"]["metadata"]["kernelhub"]["limits"][
                "memory_bytes"
            ]
            > 0
        )
    for token in (bob, None):
        with pytest.raises(websockets.InvalidStatus) as refused:
            await Channels.open(channels_url(gw, kernel, token), binary=False)
        assert refused.value.response.status_code == (404 if token else 401)
    # Alice's session is untouched by Bob's attempts.
    assert (await agent_run(gw, alice, session, "1 + 1"))["record"]["status"] == "completed"


async def test_nbclient_runs_a_notebook_with_a_plot_in_a_new_sandbox(gw: Gateway) -> None:
    alice = gw.alice  # type: ignore[attr-defined]
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import os\nprint(os.getuid(), os.path.exists('/workspace'))"),
        nbformat.v4.new_code_cell(PLOT),
        nbformat.v4.new_code_cell("sum(range(10))"),
    ]
    km = KernelhubKernelManager(gateway_url=gw.url, token=alice)
    started: list[str | None] = []
    client = NotebookClient(
        nb,
        km=km,
        timeout=int(120 * UNIT),
        startup_timeout=int(120 * UNIT),
        on_notebook_start=lambda notebook: started.append(km.gateway_kernel_id),
    )
    # cleanup_kc: nbclient stops the channels and the kernel it was handed, as when it owns them.
    await client.async_execute(cleanup_kc=True)
    first, plot, last = nb.cells
    assert first.outputs[0]["text"].split() != ["0", "True"]  # not root, in the sandbox
    assert first.outputs[0]["text"].split()[1] == "True"
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)
    assert last.outputs[0]["data"]["text/plain"] == "45"
    # The manager made the session, so it deleted it at shutdown.
    (kernel,) = started
    assert kernel is not None
    assert (await get(f"{gw.url}/api/kernels/{kernel}", alice)).status_code == 404


async def test_jupyter_client_shares_an_agent_session_and_its_history(gw: Gateway) -> None:
    alice = gw.alice  # type: ignore[attr-defined]
    session = await agent_session(gw, alice)
    await agent_run(gw, alice, session, "shared = 21")
    km = KernelhubKernelManager(gateway_url=gw.url, token=alice, session_id=session)
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60 * UNIT)
        seen: list[dict[str, Any]] = []
        answer = await kc.execute_interactive(
            "from_jupyter = shared * 2\nfrom_jupyter", timeout=60 * UNIT, output_hook=seen.append
        )
        assert answer["content"]["status"] == "ok"
        results = [m for m in seen if m["msg_type"] == "execute_result"]
        assert results[0]["content"]["data"]["text/plain"] == "42"
        # The agent's REST call sees what the Jupyter client defined, and its cell streams
        # to the Jupyter client's iopub too.
        done = await agent_run(gw, alice, session, "print('agent saw', from_jupyter)")
        assert "agent saw 42" in "".join(e.get("text", "") for e in done["events"])
        text = ""
        deadline = asyncio.get_running_loop().time() + 30 * UNIT
        while "agent saw 42" not in text:
            msg = await kc.get_iopub_msg(
                timeout=max(deadline - asyncio.get_running_loop().time(), 0.1)
            )
            if msg["msg_type"] == "stream":
                text += msg["content"]["text"]
    finally:
        kc.stop_channels()
        await km.shutdown_kernel()
    # Attached, not owned: the session outlives the Jupyter client.
    assert (await agent_run(gw, alice, session, "shared"))["record"]["status"] == "completed"
    r = await get(f"{gw.url}/v1/sessions/{session}/notebook", alice, "Bearer")
    nb = nbformat.reads(r.text, as_version=4)
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    assert "shared = 21" in sources
    assert "from_jupyter = shared * 2\nfrom_jupyter" in sources  # the Jupyter client's cell
    assert "print('agent saw', from_jupyter)" in sources
    assert sources.index("shared = 21") < sources.index("from_jupyter = shared * 2\nfrom_jupyter")


# The provisioner path as a developer takes it: kernelspecs written by
# ``python -m kernelhub.jupyter.provisioner install``, run by stock jupyter_client, nbclient
# and ``jupyter console``, which find the provisioner through its entry point.
PROVISIONERS = "jupyter_client.kernel_provisioners"


def provisioner_entry_point(site: Path) -> list[str]:
    """The sys.path entries that register the provisioner entry point pyproject.toml declares.

    A pip-installed kernelhub (CI) registers it itself: none are needed, and the installed
    one is what runs. An editable install made before the entry point existed does not, so
    the declaration is written as a dist-info of its own. Either way the entry point found
    is pyproject's."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    ((name, value),) = project["project"]["entry-points"][PROVISIONERS].items()
    assert name == PROVISIONER_NAME

    def found() -> set[str]:
        return {ep.value for ep in entry_points(group=PROVISIONERS, name=name)}

    if found() == {value}:
        return []
    dist = site / "kernelhub_provisioner_ep-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kernelhub-provisioner-ep\n")
    (dist / "entry_points.txt").write_text(f"[{PROVISIONERS}]\n{name} = {value}\n")
    sys.path.insert(0, str(site))
    assert found() == {value}, found()
    return [str(site)]


@pytest.fixture(scope="module")
def specs(gw: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Installs ``kernelhub`` (a new session per kernel, into the user's data dir) and
    ``kernelhub-attach`` (an agent's session, into a prefix); yields that session."""
    home = tmp_path_factory.mktemp("jupyter-home")
    session = asyncio.run(agent_session(gw, gw.alice))  # type: ignore[attr-defined]
    added = provisioner_entry_point(home / "site")
    env = {
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_PATH": str(home / "prefix" / "share" / "jupyter"),
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "KERNELHUB_TOKEN": gw.alice,  # type: ignore[attr-defined]
        "PYTHONPATH": os.pathsep.join(filter(None, [*added, os.environ.get("PYTHONPATH")])),
    }
    install = [sys.executable, "-m", "kernelhub.jupyter.provisioner", "install", "--url", gw.url]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        for extra in (
            ["--user"],
            ["--name", "kernelhub-attach", "--session", session, "--prefix", str(home / "prefix")],
        ):
            subprocess.run([*install, *extra], check=True, env=os.environ, timeout=60 * UNIT)
        yield session
    for entry in added:
        sys.path.remove(entry)


def run_cell(kc: Any, code: str) -> tuple[dict[str, Any], str]:
    """(execute_reply content, what the cell printed) on a blocking client."""
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "execute_result":
            out.append(msg["content"]["data"]["text/plain"])

    answer = kc.execute_interactive(code, timeout=60 * UNIT, output_hook=hook)
    return answer["content"], "".join(out)


def kernel_status(gw: Gateway, kernel: str | None) -> int:
    headers = auth(gw.alice)  # type: ignore[attr-defined]
    return httpx.get(f"{gw.url}/api/kernels/{kernel}", headers=headers, timeout=60).status_code


def test_stock_jupyter_client_runs_installed_kernelspecs_new_and_attached(
    gw: Gateway, specs: str
) -> None:
    assert {"kernelhub", "kernelhub-attach"} <= set(KernelSpecManager().find_kernel_specs())
    km, kc = start_new_kernel(kernel_name="kernelhub", startup_timeout=120 * UNIT)
    try:
        assert isinstance(km.provisioner, KernelhubProvisioner)
        kernel = km.provisioner.gateway_kernel_id
        assert kernel_status(gw, kernel) == 200  # a session of the token's principal
        answer, out = run_cell(kc, "import os\nprint(os.getuid(), os.path.isdir('/workspace'))")
        assert answer["status"] == "ok"
        assert out.split()[0] != "0" and out.split()[1] == "True"  # not root, in the sandbox
        # The manager's interrupt (a message, as the kernelspec says) stops a running cell.
        kc.execute("import time\nprint('go', flush=True)\ntime.sleep(60)")
        while kc.get_iopub_msg(timeout=60 * UNIT)["msg_type"] != "stream":
            pass
        km.interrupt_kernel()
        assert kc.get_shell_msg(timeout=30 * UNIT)["content"]["ename"] == "KeyboardInterrupt"
        assert run_cell(kc, "os.getpid() > 0")[1] == "True"  # the kernel kept its imports
        # Its restart is kernelhub's: the same session, a fresh kernel.
        km.restart_kernel()
        kc.wait_for_ready(timeout=120 * UNIT)
        assert km.provisioner.gateway_kernel_id == kernel
        assert "NameError" in run_cell(kc, "os")[0].get("ename", "")
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
    assert kernel_status(gw, kernel) == 404  # made by the provisioner, so deleted with it

    # The attaching kernelspec shares the agent's session: its variables and its record.
    asyncio.run(agent_run(gw, gw.alice, specs, "agent_value = 7"))  # type: ignore[attr-defined]
    km = KernelManager(kernel_name="kernelhub-attach")
    km.start_kernel()
    kc = km.blocking_client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120 * UNIT)
        answer, out = run_cell(kc, "jupyter_value = agent_value * 6\njupyter_value")
        assert (answer["status"], out) == ("ok", "42")
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
    done = asyncio.run(agent_run(gw, gw.alice, specs, "jupyter_value"))  # type: ignore[attr-defined]
    assert done["record"]["status"] == "completed"  # attached, not owned: the session lives on
    assert kernel_status(gw, messages.kernel_id(specs)) == 200


def test_a_refused_kernelspec_says_which_gateway_and_knob(
    gw: Gateway, specs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELHUB_TOKEN", "kh_not-a-token")
    with pytest.raises(client_errors.AuthError) as refused:
        KernelManager(kernel_name="kernelhub").start_kernel()
    assert gw.url in str(refused.value) and "KERNELHUB_TOKEN" in str(refused.value)
    # Another principal's session is not there to attach to, and nothing is launched.
    monkeypatch.setenv("KERNELHUB_TOKEN", gw.bob)  # type: ignore[attr-defined]
    km = KernelManager(kernel_name="kernelhub-attach")
    with pytest.raises(client_errors.NotFoundError) as missing:
        km.start_kernel()
    assert "KERNELHUB_SESSION" in str(missing.value) and not km.has_kernel


def test_jupyter_console_runs_a_cell_in_the_attached_session(gw: Gateway, specs: str) -> None:
    pytest.importorskip("jupyter_console")
    asyncio.run(agent_run(gw, gw.alice, specs, "for_console = 'seen by console'"))  # type: ignore[attr-defined]
    # --simple-prompt reads cells from stdin, so a pipe drives it non-interactively.
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_console", "--kernel", "kernelhub-attach",
         "--simple-prompt", "--ZMQTerminalInteractiveShell.kernel_timeout=120"],
        input="print(for_console.upper())\nexit\n",
        capture_output=True, text=True, env=os.environ, timeout=60 * UNIT,
    )  # fmt: skip
    assert "SEEN BY CONSOLE" in done.stdout, (done.stdout, done.stderr)
    r = httpx.get(
        f"{gw.url}/v1/sessions/{specs}/notebook",
        headers=auth(gw.alice, "Bearer"),  # type: ignore[attr-defined]
        timeout=60,
    )
    sources = [c.source for c in nbformat.reads(r.text, as_version=4).cells]
    assert "print(for_console.upper())" in sources  # the console's cell is in the record


def test_a_request_waits_for_the_first_iopub_subscriber(gw: Gateway, specs: str) -> None:
    # What made jupyter console's first cell hang (#21): its iopub SUB and shell DEALER
    # connect to the bridge independently (each retries every 100 ms until it binds), so
    # the shell can be answered before iopub is subscribed; an execute then publishes its
    # busy/idle to nobody and the console waits for an idle forever. Here the shell is
    # connected first on purpose and iopub only after the request was sent.
    km = KernelManager(kernel_name="kernelhub")  # a session of its own
    km.start_kernel()
    kc = km.blocking_client()
    kc.start_channels(iopub=False, stdin=False)
    try:
        msg_id = kc.execute("print('after subscribing')")
        with pytest.raises(queue.Empty):  # held while nobody listens on iopub
            kc.get_shell_msg(timeout=0.5)
        kc.iopub_channel.start()
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60 * UNIT
        while not any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                      and m["parent_header"].get("msg_id") == msg_id for m in seen):  # fmt: skip
            seen.append(kc.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.01)))
        kinds = [m["msg_type"] for m in seen]
        assert kinds[0] == "iopub_welcome"  # as ipykernel greets a subscriber (JEP 65)
        mine = [m for m in seen if m["parent_header"].get("msg_id") == msg_id]
        assert [m["msg_type"] for m in mine] == ["status", "execute_input", "stream", "status"]
        assert mine[2]["content"]["text"] == "after subscribing\n"
        assert kc.get_shell_msg(timeout=60 * UNIT)["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel()


def test_nbclient_runs_a_notebook_by_kernel_name(gw: Gateway, specs: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(PLOT), nbformat.v4.new_code_cell("sum(range(10))")]
    client = NotebookClient(
        nb, kernel_name="kernelhub", timeout=int(120 * UNIT), startup_timeout=int(120 * UNIT)
    )
    client.execute()
    plot, last = nb.cells
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)
    assert last.outputs[0]["data"]["text/plain"] == "45"


def test_a_restored_provisioner_keeps_its_session_and_deletes_it(gw: Gateway, specs: str) -> None:
    km, kc = start_new_kernel(kernel_name="kernelhub", startup_timeout=120 * UNIT)
    kc.stop_channels()
    assert isinstance(km.provisioner, KernelhubProvisioner)
    kernel = km.provisioner.gateway_kernel_id
    info = asyncio.run(km.provisioner.get_provisioner_info())
    # What a persisting manager does after its own restart: a fresh provisioner, restored.
    restored = KernelProvisionerFactory.instance().create_provisioner_instance(
        km.kernel_id, km.kernel_spec, parent=km
    )
    assert isinstance(restored, KernelhubProvisioner)
    asyncio.run(restored.load_provisioner_info(info))
    assert restored.gateway_kernel_id == kernel
    km.provisioner, was = restored, km.provisioner
    km.shutdown_kernel()  # stops the bridge by its saved pid, and the session it made
    assert was.process is not None and was.process.wait(timeout=30 * UNIT) is not None
    assert kernel_status(gw, kernel) == 404
