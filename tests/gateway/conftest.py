"""A real gateway: `kernelhub serve` in its own process on a loopback port, real Docker
sandboxes, a temporary data directory. Killable with SIGKILL and restartable on the same
data, which is how the restart tests work."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import RUN_INSTANCE, UNIT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_up(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Poll ``url`` until it answers 200; fail at once if ``proc`` exits."""
    deadline = time.monotonic() + 60 * UNIT
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args} exited: {log.read_text()[-2000:]}"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url} not ready: {log.read_text()[-2000:]}")


def kill9(proc: subprocess.Popen[bytes] | None) -> None:
    assert proc is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Gateway:
    def __init__(self, data_dir: Path, run_dir: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "KERNELHUB_DATA_DIR": str(data_dir),
            "KERNELHUB_RUN_DIR": str(run_dir),
            "KERNELHUB_BACKEND": "docker",
            "KERNELHUB_GATEWAY__PORT": str(self.port),
            "KERNELHUB_GATEWAY__INSTANCE": f"{RUN_INSTANCE}-g",
            "KERNELHUB_POOL__SIZE": "0",  # tests that want a warm pool ask for one
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"gateway-{self.port}.log"

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "kernelhub.cli", *args],
            env=self.env, capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        return out.stdout.strip()

    def token(self, name: str, *, admin: bool = False) -> str:
        return self.cli("token", "create", "--name", name, *(["--admin"] if admin else []))

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kernelhub.cli", "serve"],
                env=self.env,
                stdout=log,
                stderr=log,
            )
        wait_until_up(self.proc, f"{self.url}/readyz", self.log)

    def kill9(self) -> None:
        kill9(self.proc)

    def stop(self) -> None:
        stop(self.proc)

    def rss(self) -> int:
        assert self.proc is not None
        return int(psutil.Process(self.proc.pid).memory_info().rss)


def gateway_run_dir() -> Path:
    return Path("/run/kernelhub-test") if os.geteuid() == 0 else Path("/tmp/khrun")


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    gw = Gateway(tmp_path / "data", gateway_run_dir())
    gw.start()
    yield gw
    gw.stop()
    remove_sandboxes()


@pytest.fixture(scope="module")
def shared_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One gateway for a whole test module, for tests that do not restart it."""
    gw = Gateway(tmp_path_factory.mktemp("shared") / "data", gateway_run_dir())
    gw.start()
    yield gw
    gw.stop()
    remove_sandboxes()


def remove_sandboxes(instance: str = f"{RUN_INSTANCE}-g") -> None:
    """A stopping gateway leaves its sandboxes running for re-adoption, on purpose; the
    tests remove them (by label, as any cleanup must)."""
    import docker

    client = docker.from_env()
    label = f"org.kernelhub.instance={instance}"
    for container in client.containers.list(all=True, filters={"label": label}):
        container.remove(force=True)
    client.close()


@pytest.fixture
def make_gateway(tmp_path: Path) -> Iterator[Callable[..., Gateway]]:
    """A gateway with extra settings; stopped, and its sandboxes removed, after the test."""
    made: list[Gateway] = []

    def make(**env: str) -> Gateway:
        gw = Gateway(tmp_path / "data", gateway_run_dir(), **env)
        gw.start()
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.stop()
    remove_sandboxes()


@asynccontextmanager
async def mcp_http_server(env: dict[str, str], log: Path) -> AsyncIterator[str]:
    """``kernelhub mcp --transport http`` on a free loopback port; yields its URL."""
    port = free_port()
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kernelhub.agents.mcp_server", "--transport", "http",
            "--port", str(port), env=env, stdout=sink, stderr=sink,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30 * UNIT
        while True:
            assert proc.returncode is None, log.read_text()
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                await writer.wait_closed()
                break
            except OSError:
                assert time.monotonic() < deadline, f"no MCP HTTP server: {log.read_text()}"
                await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 30 * UNIT)
