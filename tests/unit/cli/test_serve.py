"""serve's backend choice: which backend, why, what isolation, or the one thing to do."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kernelhub.cli.serve import (
    BWRAP_ISOLATION,
    DOCKER_ISOLATION,
    NO_ISOLATION,
    DockerProbe,
    choose_backend,
)
from kernelhub.config import Settings
from kernelhub.errors import BackendUnavailableError

SOCK = "unix:///var/run/docker.sock"
UP = DockerProbe(SOCK, None, installed=True)
DOWN = DockerProbe(SOCK, "connection refused", installed=True)
ABSENT = DockerProbe(SOCK, "no socket there", installed=False)
DENIED = DockerProbe(SOCK, "permission denied", installed=True)


@pytest.mark.parametrize(
    ("requested", "docker", "bwrap", "backend", "why", "isolation"),
    [
        ("auto", UP, None, "docker", f"answers at {SOCK}", DOCKER_ISOLATION),
        ("docker", UP, None, "docker", "asked for", DOCKER_ISOLATION),
        (
            "auto",
            DOWN,
            "/usr/bin/bwrap",
            "local",
            f"not reachable at {SOCK}: connection refused",
            BWRAP_ISOLATION,
        ),
        ("local", UP, "/usr/bin/bwrap", "local", "asked for", BWRAP_ISOLATION),
    ],
)
def test_the_choice_says_which_why_and_what_isolation(
    requested: str, docker: DockerProbe, bwrap: str | None, backend: str, why: str, isolation: str
) -> None:
    choice = choose_backend(requested, docker, bwrap=bwrap, unisolated=False, root=False)
    assert (choice.backend, choice.isolation) == (backend, isolation)
    assert why in choice.why
    assert len(choice.lines()) == 2 and all("\n" not in line for line in choice.lines())


def test_bubblewrap_is_said_to_be_weaker() -> None:
    assert "weaker than Docker" in BWRAP_ISOLATION


@pytest.mark.parametrize(
    ("requested", "docker", "bwrap", "root", "command"),
    [
        ("docker", DOWN, "/usr/bin/bwrap", False, "sudo systemctl start docker"),
        ("docker", ABSENT, None, True, "`apt-get install -y docker.io`"),
        ("docker", DENIED, None, False, "sudo usermod -aG docker $USER"),
        ("local", UP, None, False, "`sudo apt-get install -y bubblewrap`"),
        ("auto", ABSENT, None, False, "`sudo apt-get install -y docker.io bubblewrap`"),
        ("auto", DOWN, None, True, "systemctl start docker"),
    ],
)
def test_a_start_that_cannot_work_stops_with_the_command_that_fixes_it(
    requested: str, docker: DockerProbe, bwrap: str | None, root: bool, command: str
) -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        choose_backend(requested, docker, bwrap=bwrap, unisolated=False, root=root)
    message = str(caught.value)
    assert command in message and "\n" not in message
    assert ("sudo" in message) is (not root)


def test_never_a_silent_fall_back_to_no_isolation() -> None:
    with pytest.raises(BackendUnavailableError):
        choose_backend("auto", DOWN, bwrap=None, unisolated=False, root=False)
    chosen = choose_backend("auto", DOWN, bwrap=None, unisolated=True, root=False)
    assert chosen.isolation == NO_ISOLATION and "NONE" in chosen.lines()[1]


async def test_a_kernelhub_error_in_the_gateways_startup_is_raised_not_logged(
    settings: Settings, capfd: pytest.CaptureFixture[str]
) -> None:
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette

    from kernelhub.cli.serve import listen_socket, run_gateway
    from kernelhub.errors import ConfigError

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        raise ConfigError("KERNELHUB_X is wrong; set KERNELHUB_X=1")
        yield

    with listen_socket("127.0.0.1", 0) as sock, pytest.raises(ConfigError, match="KERNELHUB_X"):
        await run_gateway(settings, sock, lambda s: Starlette(lifespan=lifespan))
    said = capfd.readouterr()
    assert "Traceback" not in said.err + said.out and "KERNELHUB_X" not in said.err + said.out


def test_a_port_in_use_is_one_line_naming_the_flag() -> None:
    import socket

    from kernelhub.cli.serve import listen_socket
    from kernelhub.errors import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            listen_socket("127.0.0.1", port)
    assert f"127.0.0.1:{port}" in str(caught.value) and "--port" in str(caught.value)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_connections_to_the_gateway_socket_have_nagle_off(loop: str) -> None:
    """Accepted through either event loop (as uvicorn does), a connection to the
    gateway's socket has TCP_NODELAY: REST answers leave in two writes, and with Nagle on
    the second waited for the client's delayed ACK (a steady 40 ms on a kept-alive
    connection)."""
    import asyncio

    from kernelhub.cli.serve import loop_factory

    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        assert runner.run(_nodelay_of_an_accepted_connection()) != 0


async def _nodelay_of_an_accepted_connection() -> int:
    import asyncio
    import socket

    from kernelhub.cli.serve import listen_socket

    nodelay: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        nodelay.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    sock = listen_socket("127.0.0.1", 0)
    server = await asyncio.start_server(accepted, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname())
        try:
            got = await asyncio.wait_for(nodelay, 5)
        finally:
            writer.close()
            await writer.wait_closed()
    return got
