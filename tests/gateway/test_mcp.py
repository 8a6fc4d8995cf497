"""The MCP server, complete, through the official MCP Python SDK clients against a real
gateway and real Docker sandboxes: live output as progress and log notifications, input()
and confirm() by elicitation (and answer_input without it), cancellation interrupting the
cell, an OOM the next call survives, stateless clients keeping state through the session
handle, and the workspace/notebook resources."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types
import pytest
from mcp import Client
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from kernelhub.client import AsyncHub
from tests.conftest import UNIT
from tests.gateway.conftest import Gateway, mcp_http_server

pytestmark = pytest.mark.docker

PRINTING = "import time\nfor i in range(8):\n    print('tick', i, flush=True)\n    time.sleep(0.25)"
OOM = "blocks = []\nwhile True:\n    blocks.append(bytearray(32 * 2**20))"


def text(result: mcp_types.CallToolResult | Any) -> str:
    assert isinstance(result, mcp_types.CallToolResult)
    return "".join(c.text for c in result.content if isinstance(c, mcp_types.TextContent))


@pytest.fixture
def mcp_env(gateway: Gateway) -> dict[str, str]:
    return {**os.environ, "KERNELHUB_URL": gateway.url, "KERNELHUB_TOKEN": gateway.token("mcp")}


def stdio_server(env: dict[str, str]) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable, args=["-m", "kernelhub.agents.mcp_server"], env=env
    )


@asynccontextmanager
async def authed(url: str, env: dict[str, str]) -> AsyncIterator[Any]:
    """The streamable HTTP transport sending the caller's kernelhub token, as the HTTP
    transport's token auth requires."""
    async with (
        httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {env['KERNELHUB_TOKEN']}"},
            timeout=httpx2.Timeout(60 * UNIT, read=300 * UNIT),
        ) as http,
        streamable_http_client(url, http_client=http) as streams,
    ):
        yield streams


class Seen:
    """What the client got besides results: notifications and elicitation requests."""

    def __init__(self) -> None:
        self.logs: list[tuple[float, str]] = []
        self.progress: list[tuple[float, str]] = []
        self.asked: list[str] = []
        self.answers: list[dict[str, Any]] = []

    async def on_log(self, params: mcp_types.LoggingMessageNotificationParams) -> None:
        self.logs.append((time.monotonic(), str(params.data)))

    async def on_progress(self, progress: float, total: float | None, message: str | None) -> None:
        self.progress.append((time.monotonic(), message or ""))

    async def on_elicit(
        self, context: Any, params: mcp_types.ElicitRequestParams
    ) -> mcp_types.ElicitResult:
        self.asked.append(params.message)
        return mcp_types.ElicitResult(action="accept", content=self.answers.pop(0))


async def exercise(transport: AbstractAsyncContextManager[Any]) -> None:
    seen = Seen()
    async with (
        transport as streams,
        ClientSession(
            streams[0],
            streams[1],
            logging_callback=seen.on_log,
            elicitation_callback=seen.on_elicit,
        ) as client,
    ):
        await client.initialize()

        # Live output: notifications arrive while the cell runs, coalesced (<= 10/s).
        started = time.monotonic()
        printed = await client.call_tool(
            "execute_python", {"code": PRINTING}, progress_callback=seen.on_progress
        )
        ended = time.monotonic()
        assert "tick 7" in text(printed)
        for kind in (seen.progress, seen.logs):
            early = [m for t, m in kind if t < ended - 0.3]
            assert len(early) >= 2, kind  # several, before the result
            assert "tick 0" in "".join(m for _, m in kind) and "tick 7" in "".join(
                m for _, m in kind
            )
            assert len(kind) <= (ended - started) * 10 + 2, kind

        # input() and confirm() by elicitation.
        seen.answers += [{"value": "Ada"}, {"answer": True}]
        asked = await client.call_tool(
            "execute_python",
            {"code": "name = input('name? ')\nprint('hi', name, confirm('go on?'))"},
        )
        assert text(asked) == "[stdout]\nhi Ada True\n", text(asked)
        assert "name? " in seen.asked[0] and "go on?" in seen.asked[1]

        # A cancelled call interrupts its cell: the next call runs promptly.
        await client.call_tool("execute_python", {"code": "kept = 41"})
        with pytest.raises(MCPError):
            await client.call_tool(
                "execute_python", {"code": "while True: pass"}, read_timeout_seconds=2
            )
        t0 = time.monotonic()
        after = await client.call_tool(  # an uninterrupted cell would hold it for 300 s
            "execute_python", {"code": "print(kept + 1)"}, read_timeout_seconds=20 * UNIT
        )
        assert text(after) == "[stdout]\n42\n" and time.monotonic() - t0 < 15 * UNIT

        # Resources: a workspace file and the notebook.
        await client.call_tool("upload_file", {"path": "notes/a.txt", "text": "hello"})
        resources = (await client.list_resources()).resources
        uris = [str(r.uri) for r in resources]
        notebook = next(u for u in uris if u.endswith("/notebook.ipynb"))
        workspace = next(u for u in uris if u.endswith("/workspace/notes/a.txt"))
        read = (await client.read_resource(workspace)).contents[0]
        assert isinstance(read, mcp_types.TextResourceContents) and read.text == "hello"
        nb = (await client.read_resource(notebook)).contents[0]
        assert isinstance(nb, mcp_types.TextResourceContents)
        assert "kept = 41" in "".join("".join(c["source"]) for c in json.loads(nb.text)["cells"])

        # An OOM: the call says the kernel died, and the next call works and says so.
        oom = await client.call_tool("execute_python", {"code": OOM, "timeout": 60})
        assert "kernel_died" in text(oom) and "[kernel]" in text(oom), text(oom)
        again = await client.call_tool("execute_python", {"code": "print('alive')"})
        assert "alive" in text(again) and not again.is_error, text(again)


async def test_mcp_stdio_live_output_input_cancel_oom(mcp_env: dict[str, str]) -> None:
    with open(os.devnull, "w") as errlog:
        await exercise(stdio_client(stdio_server(mcp_env), errlog=errlog))


async def test_mcp_http_live_output_input_cancel_oom(
    mcp_env: dict[str, str], tmp_path: Path
) -> None:
    async with mcp_http_server(mcp_env, tmp_path / "mcp.log") as url:
        await exercise(authed(url, mcp_env))


async def test_mcp_stateless_client_keeps_state_through_the_handle(
    mcp_env: dict[str, str], tmp_path: Path
) -> None:
    async with (
        mcp_http_server(mcp_env, tmp_path / "mcp.log") as url,
        Client(authed(url, mcp_env)) as client,
    ):
        assert "session" in (await client.list_tools()).tools[0].input_schema["properties"]
        first = await client.call_tool("execute_python", {"code": "z = 5"})
        handle = text(first).rsplit("[session handle: ", 1)[1].rstrip("]")
        lost = await client.call_tool("execute_python", {"code": "print(z)"})
        assert "NameError" in text(lost)  # every stateless call is a fresh context
        kept = await client.call_tool("execute_python", {"code": "print(z)", "session": handle})
        assert text(kept).startswith("[stdout]\n5\n"), text(kept)

        # A dropped request (the caller gives up on it) interrupts its cell too.
        with anyio.move_on_after(2):
            await client.call_tool(
                "execute_python", {"code": "while True: pass", "session": handle}
            )
        t0 = time.monotonic()
        prompt = await client.call_tool(
            "execute_python", {"code": "print(z + 1)", "session": handle}
        )
        assert text(prompt).startswith("[stdout]\n6\n") and time.monotonic() - t0 < 15 * UNIT

        # Without elicitation the call returns saying the cell waits; answer_input answers.
        waiting = await client.call_tool(
            "execute_python",
            {"code": "print('before')\nv = input('size? ')\nprint(int(v) * 2)", "session": handle},
        )
        assert "[waiting for input]" in text(waiting) and "size? " in text(waiting)
        done = await client.call_tool("answer_input", {"value": "21", "session": handle})
        assert "before" in text(done) and "42" in text(done), text(done)
        asking = await client.call_tool(
            "execute_python", {"code": "input('never answered? ')", "session": handle}
        )
        assert "[waiting for input]" in text(asking)
        stopped = await client.call_tool("interrupt", {"session": handle})
        assert "KeyboardInterrupt" in text(stopped) or "interrupted" in text(stopped), text(stopped)
        still = await client.call_tool("execute_python", {"code": "print(z)", "session": handle})
        assert text(still).startswith("[stdout]\n5\n"), text(still)


async def test_mcp_idle_handles_expire(gateway: Gateway, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KERNELHUB_URL": gateway.url,
        "KERNELHUB_TOKEN": gateway.token("mcp-idle"),
        "KERNELHUB_MCP_HANDLE_IDLE_TIMEOUT": "1",
    }
    async with (
        mcp_http_server(env, tmp_path / "mcp.log") as url,
        Client(authed(url, env)) as client,
    ):
        first = await client.call_tool("execute_python", {"code": "z = 5"})
        handle = text(first).rsplit("[session handle: ", 1)[1].rstrip("]")
        async with AsyncHub(gateway.url, env["KERNELHUB_TOKEN"]) as hub:
            deadline = time.monotonic() + 20 * UNIT
            while await hub.list_sessions():  # the reaper deletes the idle handle's session
                assert time.monotonic() < deadline, "the idle handle's session was not deleted"
                await asyncio.sleep(0.1)
        later = await client.call_tool("execute_python", {"code": "print(z)", "session": handle})
        assert "expired" in text(later) and "NameError" in text(later), text(later)
        assert handle not in text(later).rsplit("[session handle: ", 1)[1]


# -- the official TypeScript SDK client (tests/agents/ts, `npm ci` there) -------------------

TS_DIR = Path(__file__).parent.parent / "agents" / "ts"


async def ts_client(mode: str, target: str, env: dict[str, str]) -> dict[str, Any]:
    if not (TS_DIR / "node_modules" / "@modelcontextprotocol" / "sdk").is_dir():
        pytest.fail(f"the TypeScript MCP SDK is not installed: run `npm ci` in {TS_DIR}")
    proc = await asyncio.create_subprocess_exec(
        "node", "client.mjs", mode, target, cwd=TS_DIR, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 100 * UNIT)
    assert proc.returncode == 0, err.decode()[-3000:]
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def check_ts(seen: dict[str, Any]) -> None:
    start, end = seen["printed_ms"]
    assert "tick 7" in seen["printed"]
    for kind in (seen["seen"]["progress"], seen["seen"]["logs"]):
        assert len([m for t, m in kind if t < end - 300]) >= 2, kind
        assert "tick 0" in "".join(m for _, m in kind)
        assert len(kind) <= (end - start) / 100 + 2, kind
    assert seen["asked"] == "[stdout]\nhi Ada True\n", seen["asked"]
    assert "name? " in seen["seen"]["asked"][0]
    assert "timed out" in seen["cancelled"].lower(), seen["cancelled"]
    assert seen["after"] == "[stdout]\n42\n" and seen["after_ms"] < 15000 * UNIT
    assert "kernel_died" in seen["oom"] and "[kernel]" in seen["oom"], seen["oom"]
    assert "alive" in seen["again"], seen["again"]


async def test_mcp_typescript_sdk_over_stdio(mcp_env: dict[str, str]) -> None:
    check_ts(await ts_client("stdio", sys.executable, mcp_env))


async def test_mcp_typescript_sdk_over_http(mcp_env: dict[str, str], tmp_path: Path) -> None:
    async with mcp_http_server(mcp_env, tmp_path / "mcp.log") as url:
        check_ts(await ts_client("http", url, mcp_env))
