"""The agent tools against a real gateway and real Docker sandboxes: ToolRunner, the
example loop, and the MCP server driven by the mcp SDK's own client over stdio and
streamable HTTP."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx2
import mcp_types
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from kernelhub.agents.example_loop import ScriptedModel, agent_loop
from kernelhub.agents.tools import ToolRunner
from kernelhub.client import AsyncHub, AsyncSession
from tests.conftest import UNIT, eventually
from tests.gateway.conftest import Gateway, mcp_http_server

pytestmark = pytest.mark.docker


@pytest.fixture
async def hub(gateway: Gateway) -> AsyncIterator[AsyncHub]:
    async with AsyncHub(gateway.url, gateway.token("agents"), timeout=60 * UNIT) as hub:
        yield hub


@pytest.fixture
async def session(hub: AsyncHub) -> AsyncIterator[AsyncSession]:
    async with await hub.create_session() as session:
        yield session


async def test_runner_keeps_state_between_calls(session: AsyncSession) -> None:
    runner = ToolRunner(session)
    first = await runner.run("execute_python", {"code": "x = 20"})
    assert first.text == "(no output)" and not first.is_error
    second = await runner.run("execute_python", '{"code": "x * 2 + 2"}')
    assert second.text == "[result]\n42"


async def test_runner_summarizes_an_error(session: AsyncSession) -> None:
    result = await ToolRunner(session).run(
        "execute_python", {"code": "def f():\n    return 1 / 0\nf()"}
    )
    assert result.is_error
    assert "[error]\nZeroDivisionError: division by zero" in result.text
    assert "return 1 / 0" in result.text
    assert "\x1b" not in result.text
    # A library error: the user's frames and the exception stay, pandas' middle goes.
    code = "import pandas as pd\ndef pick(df):\n    return df['missing']\npick(pd.DataFrame({'a': [1]}))"
    library = await ToolRunner(session).run("execute_python", {"code": code})
    assert "Cell In[2], line 4" in library.text and "return df['missing']" in library.text
    assert "library frame" in library.text and "frame.py" not in library.text
    assert library.text.rstrip().endswith("KeyError: 'missing'")


async def test_runner_returns_a_plot_as_an_image(session: AsyncSession) -> None:
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
    result = await ToolRunner(session).run("execute_python", {"code": code})
    assert not result.is_error, result.text
    assert [a.mime_type for a in result.images] == ["image/png"]
    assert result.images[0].data_base64.startswith("iVBORw0KGgo")  # the PNG signature
    block = result.to_anthropic_block("toolu_1")
    assert block["content"][1]["source"]["media_type"] == "image/png"


async def test_runner_truncates_a_huge_print(session: AsyncSession) -> None:
    code = "print('START' + 'x' * 200_000 + 'END')"
    result = await ToolRunner(session, max_chars=2000).run("execute_python", {"code": code})
    assert len(result.text) <= 2000
    assert "START" in result.text and "END" in result.text
    assert "… [truncated " in result.text


async def test_runner_files_and_snapshot(session: AsyncSession) -> None:
    runner = ToolRunner(session)
    assert not (await runner.run("upload_file", {"path": "n.txt", "text": "7"})).is_error
    read = await runner.run("execute_python", {"code": "print(int(open('n.txt').read()) * 6)"})
    assert read.text == "[stdout]\n42\n"
    missing = await runner.run("download_file", {"path": "missing.txt"})
    assert missing.is_error and "download_file was refused" in missing.text
    await runner.run("execute_python", {"code": "y = 5"})
    snap = await runner.run("snapshot", {})
    assert snap.text.startswith("snapshot ") and "y" in snap.text


async def test_interrupt_stops_a_running_cell(session: AsyncSession) -> None:
    runner = ToolRunner(session)
    running = asyncio.create_task(
        runner.run("execute_python", {"code": "import time\nfor i in range(600): time.sleep(0.1)"})
    )
    try:
        await eventually(lambda: bool(runner._running), timeout=30)
        stopped = await runner.run("interrupt", {})
        assert "sent KeyboardInterrupt to 1" in stopped.text
        result = await asyncio.wait_for(running, 30 * UNIT)
    finally:
        running.cancel()
    assert result.is_error and "KeyboardInterrupt" in result.text


async def test_example_loop_reads_5050_from_the_tool(session: AsyncSession) -> None:
    answer = await agent_loop(
        ScriptedModel(), ToolRunner(session), "compute the sum of 1..100 and verify it with Python"
    )
    assert answer == "The sum is 5050, verified with Python."


async def test_scripted_model_reports_what_the_tool_said(session: AsyncSession) -> None:
    # The model reads the number from the tool result: break `sum` and the answer changes.
    runner = ToolRunner(session)
    await runner.run("execute_python", {"code": "sum = lambda r: 42"})
    answer = await agent_loop(ScriptedModel(), runner, "compute the sum of 1..100 please")
    assert answer == "The sum is 42, verified with Python."


# -- MCP -------------------------------------------------------------------------------


def _text(result: mcp_types.CallToolResult | Any) -> str:
    assert isinstance(result, mcp_types.CallToolResult)
    return "".join(c.text for c in result.content if isinstance(c, mcp_types.TextContent))


async def _exercise(transport: AbstractAsyncContextManager[Any]) -> None:
    async with transport as streams, ClientSession(streams[0], streams[1]) as client:
        await client.initialize()
        tools = await client.list_tools()
        assert [t.name for t in tools.tools] == [
            "execute_python", "upload_file", "download_file", "interrupt", "snapshot",
            "answer_input",
        ]  # fmt: skip
        assert tools.tools[0].input_schema["required"] == ["code"]
        first = await client.call_tool("execute_python", {"code": "secret = 6 * 7"})
        assert isinstance(first, mcp_types.CallToolResult) and not first.is_error, _text(first)
        second = await client.call_tool("execute_python", {"code": "print(secret)"})
        assert _text(second) == "[stdout]\n42\n"
        bad = await client.call_tool("execute_python", {"cod": "1"})
        assert isinstance(bad, mcp_types.CallToolResult) and bad.is_error
        assert "code: Field required" in _text(bad)
        plot = await client.call_tool(
            "execute_python",
            {"code": "import matplotlib.pyplot as plt\nplt.plot([3, 1])\nplt.show()"},
        )
        assert isinstance(plot, mcp_types.CallToolResult)
        images = [c for c in plot.content if isinstance(c, mcp_types.ImageContent)]
        assert [i.mime_type for i in images] == ["image/png"]


async def _no_sessions_left(hub: AsyncHub) -> None:
    """The MCP session's kernel is deleted when the MCP session ends."""
    deadline = time.monotonic() + 30 * UNIT
    while await hub.list_sessions():
        assert time.monotonic() < deadline, "the MCP server left its kernelhub session behind"
        await asyncio.sleep(0.1)


@pytest.fixture
def mcp_env(gateway: Gateway) -> dict[str, str]:
    return {**os.environ, "KERNELHUB_URL": gateway.url, "KERNELHUB_TOKEN": gateway.token("mcp")}


async def test_mcp_stdio_keeps_state_within_a_session(
    gateway: Gateway, mcp_env: dict[str, str]
) -> None:
    server = StdioServerParameters(
        command=sys.executable, args=["-m", "kernelhub.agents.mcp_server"], env=mcp_env
    )
    with open(os.devnull, "w") as errlog:
        await _exercise(stdio_client(server, errlog=errlog))
    async with AsyncHub(gateway.url, mcp_env["KERNELHUB_TOKEN"]) as hub:
        await _no_sessions_left(hub)


async def test_mcp_streamable_http_runs_as_the_callers_token(
    gateway: Gateway, mcp_env: dict[str, str], tmp_path: Path
) -> None:
    # The server gets no token of its own: tools can only run as the client's principal.
    env = {k: v for k, v in mcp_env.items() if k != "KERNELHUB_TOKEN"}
    token = mcp_env["KERNELHUB_TOKEN"]
    async with mcp_http_server(env, tmp_path / "mcp-http.log") as url:
        initialize = {
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "0"}},
        }  # fmt: skip
        accept = {"Accept": "application/json, text/event-stream"}
        for headers in ({}, {"Authorization": "Bearer kh_not-a-token"}):
            async with httpx2.AsyncClient(headers={**headers, **accept}) as anonymous:
                r = await anonymous.post(url, json=initialize)
                assert r.status_code == 401, r.text
                assert r.headers["www-authenticate"].startswith("Bearer")
                with pytest.raises((MCPError, BaseExceptionGroup)):
                    await _exercise(streamable_http_client(url, http_client=anonymous))
        async with httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=120 * UNIT
        ) as authed:
            await _exercise(streamable_http_client(url, http_client=authed))
        async with AsyncHub(gateway.url, token) as hub:
            await _no_sessions_left(hub)
