"""The SDK's lifetimes and shortcuts against a real gateway and real Docker sandboxes: a
temporary Hub, a Session that outlives its Hub, ``Hub()`` from the environment, the
execution id (``on_start``) used to interrupt from another thread or task, and
``Execution.results``."""

from __future__ import annotations

import asyncio
import base64
import gc
import threading
import time

import pytest

from kernelhub.client import (
    AsyncHub,
    AuthError,
    ClientError,
    Execution,
    ExecutionStatus,
    Hub,
    Result,
)
from tests.conftest import UNIT
from tests.gateway.conftest import Gateway

pytestmark = pytest.mark.docker

_PLOT = (
    "import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
    "import matplotlib.pyplot as plt\nfrom IPython.display import HTML, display\n"
    "display(HTML('<b>hi</b>'))\nplt.plot([1, 2, 3])\nplt.show()\n6 * 7"
)


def _wait_for(predicate: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout * UNIT
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"condition not met within {timeout * UNIT:g} s"
        time.sleep(0.01)


def test_sync_hub_and_session_lifetimes(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    token = gateway.token("sdk")
    # A temporary Hub lives as long as the call on it; a bad token is an AuthError.
    assert Hub(gateway.url, token).list_sessions() == []
    with pytest.raises(AuthError):
        Hub(gateway.url, "kh_not-a-token").list_sessions()
    # Hub() reads KERNELHUB_URL / KERNELHUB_TOKEN.
    monkeypatch.setenv("KERNELHUB_URL", gateway.url)
    monkeypatch.setenv("KERNELHUB_TOKEN", token)
    with Hub() as hub:
        session = hub.create_session()
    # The hub refuses, in those words; the session it gave out keeps working.
    with pytest.raises(ClientError, match="this Hub is closed"):
        hub.list_sessions()
    assert session.run("print(6 * 7)").stdout == "42\n"
    # A session from a temporary Hub works too, after the Hub object is long gone.
    orphan = Hub().create_session()
    gc.collect()
    assert orphan.run("1 + 1").text == "2"
    # Leaving `with session:` deletes the sandbox, even though its Hub is closed.
    with session:
        pass
    with orphan:
        pass
    assert Hub().list_sessions() == []

    # The execution id arrives as soon as the cell is accepted: another thread interrupts.
    with Hub() as hub, hub.create_session() as live:
        started: list[str] = []
        outcome: list[Execution] = []
        runner = threading.Thread(
            target=lambda: outcome.append(
                live.run("import time\ntime.sleep(60)", on_start=started.append)
            )
        )
        runner.start()
        _wait_for(lambda: started, 30)
        live.interrupt(started[0])
        runner.join(30 * UNIT)
        assert outcome and outcome[0].id == started[0]
        assert outcome[0].status is ExecutionStatus.INTERRUPTED
        assert outcome[0].error is not None and outcome[0].error.name == "KeyboardInterrupt"
        # Rich outputs: REST and streamed runs give the same results.
        plain = live.run(_PLOT)
        seen: list[Result] = []
        streamed = live.run(_PLOT, on_result=seen.append)
    for execution in (plain, streamed):
        html, png, value = execution.results
        assert html.html == "<b>hi</b>" and not html.is_main_result
        assert png.png is not None and base64.b64decode(png.png).startswith(b"\x89PNG")
        assert value.is_main_result and value.text == "42"
    assert [r.formats() for r in seen] == [r.formats() for r in streamed.results]


async def test_async_session_outlives_its_hub_and_is_interrupted_by_id(gateway: Gateway) -> None:
    token = gateway.token("sdk-async")
    async with AsyncHub(gateway.url, token, timeout=60 * UNIT) as hub:
        session = await hub.create_session()
    with pytest.raises(ClientError, match="this Hub is closed"):
        await hub.list_sessions()
    # The pool stays open for the session; its cell failing is data, plain and coloured.
    failed = await session.run("d = {}\nd['missing']")
    assert failed.error is not None and failed.error.name == "KeyError"
    assert not any("\x1b" in line for line in failed.error.traceback)
    assert any("\x1b" in line for line in failed.error.traceback_ansi)
    assert "Cell In[1], line 2" in failed.error.traceback_text
    # on_start hands the id out while the cell runs: another task interrupts with it.
    started: asyncio.Queue[str] = asyncio.Queue()
    running = asyncio.create_task(session.run("import time\ntime.sleep(60)", on_start=started.put))
    execution_id = await asyncio.wait_for(started.get(), 30 * UNIT)
    await session.interrupt(execution_id)
    execution = await asyncio.wait_for(running, 30 * UNIT)
    assert execution.id == execution_id and execution.status is ExecutionStatus.INTERRUPTED
    async with session:  # deleting it closes the pool the closed hub left open for it
        pass
    assert hub._http.is_closed
    async with AsyncHub(gateway.url, token) as other:
        assert await other.list_sessions() == []
