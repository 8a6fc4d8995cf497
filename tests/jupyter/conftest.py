"""One real gateway (real Docker sandboxes) per test module, tokens for two principals,
and a Jupyter kernel-WebSocket client written from the protocol (JSON or v1 binary
framing) that drives a channels socket as JupyterLab does."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from kernelhub.jupyter import messages
from tests.conftest import UNIT
from tests.gateway.conftest import Gateway, remove_sandboxes


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    run_dir = Path("/run/kernelhub-test") if os.geteuid() == 0 else Path("/tmp/khrun")
    gateway = Gateway(tmp_path_factory.mktemp("jupyter") / "data", run_dir)
    gateway.start()
    gateway.alice = gateway.token("alice")  # type: ignore[attr-defined]
    gateway.bob = gateway.token("bob")  # type: ignore[attr-defined]
    yield gateway
    gateway.stop()
    remove_sandboxes()


def auth(token: str, scheme: str = "token") -> dict[str, str]:
    return {"Authorization": f"{scheme} {token}"}


# Plain blocking httpx in a thread: these tests' own calls to the gateway never share the
# event loop with the Jupyter clients under test.
async def agent_session(gw: Gateway, token: str) -> str:
    r = await asyncio.to_thread(
        httpx.post, f"{gw.url}/v1/sessions", json={}, headers=auth(token, "Bearer"), timeout=120
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def agent_run(gw: Gateway, token: str, session_id: str, code: str) -> dict[str, Any]:
    r = await asyncio.to_thread(
        httpx.post,
        f"{gw.url}/v1/sessions/{session_id}/executions",
        json={"code": code, "wait": True},
        headers=auth(token, "Bearer"),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def get(url: str, token: str, scheme: str = "token") -> httpx.Response:
    return await asyncio.to_thread(httpx.get, url, headers=auth(token, scheme), timeout=60)


def channels_url(gw: Gateway, kernel: str, token: str | None = None) -> str:
    url = f"{gw.ws_url}/api/kernels/{kernel}/channels"
    return url if token is None else f"{url}?token={token}"


class Channels:
    """A client of ``/api/kernels/{id}/channels``: sends requests, collects what answers
    them (by parent msg_id), and shows everything else it saw in ``seen``."""

    def __init__(self, ws: Any, *, binary: bool) -> None:
        self.ws = ws
        self.binary = binary
        self.session = uuid.uuid4().hex
        self.seen: list[dict[str, Any]] = []

    @classmethod
    async def open(
        cls, url: str, headers: dict[str, str] | None = None, *, binary: bool
    ) -> Channels:
        ws = await websockets.connect(
            url,
            additional_headers=headers or {},
            subprotocols=[messages.V1_SUBPROTOCOL] if binary else None,  # type: ignore[list-item]
            max_size=None,
        )
        # Offered, the server may still decline it (Jupyter Server does in gateway mode).
        return cls(ws, binary=ws.subprotocol == messages.V1_SUBPROTOCOL)

    async def close(self) -> None:
        await self.ws.close()

    async def send(self, channel: str, msg_type: str, content: dict[str, Any]) -> str:
        msg = messages.message(channel, msg_type, content, {}, self.session)
        frame = messages.to_v1_frame(msg) if self.binary else messages.to_json_frame(msg)
        await self.ws.send(frame)
        return str(msg["header"]["msg_id"])

    async def next(self, timeout: float) -> dict[str, Any]:
        frame = await asyncio.wait_for(self.ws.recv(), timeout * UNIT)
        if self.binary:
            assert isinstance(frame, bytes), "the v1 subprotocol sends binary frames"
            msg = messages.from_v1_frame(frame)
        else:
            msg = json.loads(frame)
        self.seen.append(msg)
        return msg

    async def until(self, msg_id: str, pred: Any, timeout: float = 60) -> list[dict[str, Any]]:
        """Messages whose parent is ``msg_id``, up to the first that ``pred`` accepts."""
        deadline = time.monotonic() + timeout * UNIT
        got = []
        while True:
            msg = await self.next(max(deadline - time.monotonic(), 0.01))
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            got.append(msg)
            if pred(msg):
                return got

    async def request(
        self, channel: str, msg_type: str, content: dict[str, Any], timeout: float = 60
    ) -> list[dict[str, Any]]:
        """A request, then its messages up to its reply and the idle status after it."""
        msg_id = await self.send(channel, msg_type, content)
        replied = False

        def done(msg: dict[str, Any]) -> bool:
            nonlocal replied
            replied = replied or msg["header"]["msg_type"].endswith("_reply")
            idle = (
                msg["header"]["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            )
            return replied and idle

        return await self.until(msg_id, done, timeout)

    async def answer_input(self, code: str, value: str) -> tuple[str, list[dict[str, Any]]]:
        """Run ``code``, answer the stdin prompt it shows with ``value``: (prompt, messages
        up to the execute_reply)."""
        msg_id = await self.send("shell", "execute_request", {"code": code, "allow_stdin": True})
        asked = await self.until(msg_id, lambda m: m["header"]["msg_type"] == "input_request")
        assert asked[-1]["channel"] == "stdin"
        await self.send("stdin", "input_reply", {"value": value})
        msgs = await self.until(msg_id, lambda m: m["header"]["msg_type"] == "execute_reply")
        return str(asked[-1]["content"]["prompt"]), msgs

    async def execute(self, code: str, timeout: float = 60, **extra: Any) -> list[dict[str, Any]]:
        return await self.request(
            "shell",
            "execute_request",
            {"code": code, "silent": False, "allow_stdin": True, **extra},
            timeout,
        )


def of_type(msgs: list[dict[str, Any]], msg_type: str) -> list[dict[str, Any]]:
    return [m for m in msgs if m["header"]["msg_type"] == msg_type]


def reply(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [m for m in msgs if m["header"]["msg_type"].endswith("_reply")]
    return found["content"]  # type: ignore[no-any-return]


def stdout(msgs: list[dict[str, Any]]) -> str:
    return "".join(
        m["content"]["text"] for m in of_type(msgs, "stream") if m["content"]["name"] == "stdout"
    )


PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
