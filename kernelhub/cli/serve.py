"""``kernelhub serve``: check the machine, say which sandbox backend runs and why, build the
kernel image on first use, serve, and only then make the first admin token.

Order matters for a newcomer: a start that cannot work stops before anything is printed
that looks like success (a token for a gateway that never ran was the old failure), and
says in one line what to install or start. :func:`choose_backend` is the pure decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kernelhub.config import Settings
from kernelhub.errors import BackendUnavailableError, ConfigError, ImageError, KernelhubError

DOCKER_ISOLATION = (
    "one locked-down container per session: no network, read-only root, no capabilities, "
    "seccomp, non-root, memory/CPU/pids limits"
)
BWRAP_ISOLATION = (
    "bubblewrap namespaces on this host: no network and a private /workspace, but weaker "
    "than Docker: no memory/CPU/pids limits, the host's system directories visible read-only"
)
NO_ISOLATION = (
    "NONE: kernels run as plain host processes with your user's rights "
    "(KERNELHUB_LOCAL__UNISOLATED is set and bubblewrap is missing)"
)


@dataclass(frozen=True)
class DockerProbe:
    """What ``serve`` found out about Docker before choosing a backend."""

    where: str  # the daemon address tried
    problem: str | None  # None: it answered
    installed: bool  # a docker/dockerd binary is on PATH


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # "docker" or "local"
    why: str
    isolation: str

    def lines(self) -> list[str]:
        return [f"backend: {self.backend} ({self.why})", f"isolation: {self.isolation}"]


def install_command(packages: list[str], *, root: bool) -> str:
    return f"{'' if root else 'sudo '}apt-get install -y {' '.join(packages)}"


def docker_fix(probe: DockerProbe, *, root: bool) -> str:
    """The one command that gets a Docker daemon answering at ``probe.where``."""
    sudo = "" if root else "sudo "
    if not probe.installed:
        return f"install it: `{install_command(['docker.io'], root=root)}`"
    if probe.problem and "permission denied" in probe.problem.lower():
        return f"let your user use it: `{sudo}usermod -aG docker $USER` (then log in again)"
    return f"start it: `{sudo}systemctl start docker` (or `{sudo}dockerd &`)"


def choose_backend(
    requested: str, docker: DockerProbe, *, bwrap: str | None, unisolated: bool, root: bool
) -> BackendChoice:
    """The backend ``serve`` runs, with its reason and isolation, or a
    :class:`BackendUnavailableError` whose message is the one thing to do. Never falls
    back to running without isolation unless ``unisolated`` was set explicitly."""
    down = f"the Docker daemon is not reachable at {docker.where}: {docker.problem}"
    if requested == "docker":
        if docker.problem is not None:
            raise BackendUnavailableError(
                f"the docker backend was asked for (--backend / KERNELHUB_BACKEND) but {down}; "
                f"{docker_fix(docker, root=root)}, or use --backend local"
            )
        return BackendChoice(
            "docker", f"asked for; the daemon answers at {docker.where}", DOCKER_ISOLATION
        )
    if requested == "auto" and docker.problem is None:
        return BackendChoice(
            "docker", f"the Docker daemon answers at {docker.where}", DOCKER_ISOLATION
        )
    why = "asked for" if requested == "local" else down
    if bwrap is not None:
        return BackendChoice("local", why, BWRAP_ISOLATION)
    if unisolated:
        return BackendChoice("local", why, NO_ISOLATION)
    if requested == "local":
        raise BackendUnavailableError(
            "the local backend needs bubblewrap, which is not installed; install it: "
            f"`{install_command(['bubblewrap'], root=root)}` (or set KERNELHUB_LOCAL__UNISOLATED=1 "
            "to run kernels without any isolation)"
        )
    raise BackendUnavailableError(
        f"no sandbox is available: {down}, and bubblewrap is not installed; install both: "
        f"`{install_command(['docker.io', 'bubblewrap'], root=root)}`"
        + (
            ""
            if not docker.installed
            else f" — Docker is installed: {docker_fix(docker, root=root)}"
        )
    )


def probe_docker(base_url: str | None) -> DockerProbe:
    """Ping the daemon (3 s at most) and say where, and what went wrong, in a few words."""
    import docker

    where = base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    installed = bool(shutil.which("dockerd") or shutil.which("docker"))
    try:
        client = (
            docker.DockerClient(base_url=base_url, timeout=3)
            if base_url
            else docker.from_env(timeout=3)
        )
        try:
            client.ping()
        finally:
            client.close()
    except (docker.errors.DockerException, OSError) as exc:
        return DockerProbe(where, _short(exc), installed)
    return DockerProbe(where, None, installed)


def _short(exc: BaseException) -> str:
    text = str(exc)
    for needle, said in (
        ("FileNotFoundError", "no socket there"),
        ("No such file", "no socket there"),
        ("PermissionError", "permission denied"),
        ("Permission denied", "permission denied"),
        ("Connection refused", "connection refused"),
        ("timed out", "timed out"),
    ):
        if needle in text:
            return said
    return text.splitlines()[0][:120] if text else type(exc).__name__


# ---------------------------------------------------------------------------- serve


def serve(
    settings: Settings,
    *,
    build: bool = True,
    app_factory: Callable[[Settings, Any], Any] | None = None,
    tls: dict[str, Any] | None = None,
) -> int:
    """Run the gateway in the foreground until interrupted; the exit status. A node agent
    (``kernelhub node``) is the same with its own ``app_factory(settings, lock)`` and
    ``tls`` (uvicorn's ``ssl_*`` options: mutual TLS)."""
    from kernelhub.datadir import DataDirLock
    from kernelhub.gateway.app import create_app
    from kernelhub.sandbox.local import bwrap_path

    # Before anything touches the data directory: a second gateway on it stops here.
    lock = DataDirLock.acquire(settings.data_dir)
    # Bound first, listening only once the gateway is up: a port in use fails at once.
    with listen_socket(settings.gateway.host, settings.gateway.port) as sock:
        choice = choose_backend(
            settings.backend,
            probe_docker(settings.docker.base_url),
            bwrap=bwrap_path(),
            unisolated=settings.local.unisolated,
            root=os.geteuid() == 0,
        )
        for line in choice.lines():
            print(line, flush=True)
        print(server_line(settings), flush=True)
        settings = settings.model_copy(update={"backend": choice.backend})
        if choice.backend == "docker":
            ensure_image(settings, build=build)
        factory = app_factory or (lambda s, lock: create_app(s, data_dir_lock=lock))
        return run_on_gateway_loop(
            settings, run_gateway(settings, sock, lambda s: factory(s, lock), tls=tls)
        )


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``KERNELHUB_GATEWAY__EVENT_LOOP`` asks for: uvloop's (``auto``: when it
    is installed), or None for the standard library's."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "auto":
            return None
        raise ConfigError(
            "KERNELHUB_GATEWAY__EVENT_LOOP=uvloop but uvloop is not installed; "
            "`pip install uvloop`, or set KERNELHUB_GATEWAY__EVENT_LOOP=auto"
        ) from exc
    return uvloop.new_event_loop


def server_line(settings: Settings) -> str:
    """What serves the gateway's sockets, for ``serve``'s start-up lines."""
    loop = "asyncio" if loop_factory(settings.gateway.event_loop) is None else "uvloop"
    return f"event loop: {loop}; HTTP parser: {settings.gateway.http_parser}"


def run_on_gateway_loop(settings: Settings, main: Coroutine[Any, Any, int]) -> int:
    """``asyncio.run(main)`` on the gateway's event loop (see :func:`loop_factory`)."""
    # asyncio.Runner, not uvloop.run: the same shutdown (cancel tasks, shut down async
    # generators and the default executor) on either loop.
    with asyncio.Runner(loop_factory=loop_factory(settings.gateway.event_loop)) as runner:
        return runner.run(main)


def ensure_image(settings: Settings, *, build: bool) -> None:
    """The kernel image exists and speaks our protocol; a missing one is built (first use)."""
    from kernelhub.image.build import check_image, docker_client, image_exists

    client = docker_client(settings)
    try:
        try:
            info = check_image(client, settings.docker.image)
        except ImageError:
            # Present but not ours, or for another protocol: the message says what to do.
            if not build or image_exists(client, settings.docker.image):
                raise
            print(f"kernel image {settings.docker.image} not found; building it (first use)")
            from kernelhub.cli.host import build_kernel_image

            build_kernel_image(settings, client=client)
            return
    finally:
        client.close()
    print(f"kernel image: {info.name} (python {info.python_version or '?'})", flush=True)


class _StartupWatch:
    """Wraps the ASGI app to catch a kernelhub error in the lifespan startup: uvicorn would
    log its traceback; ``serve`` prints the message as one line instead."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.error: KernelhubError | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def watched(message: Any) -> None:
            # Starlette sends startup.failed from inside its ``except`` block.
            exc = sys.exc_info()[1]
            if message["type"] == "lifespan.startup.failed" and isinstance(exc, KernelhubError):
                self.error = exc
                message = {**message, "message": ""}
            await send(message)

        await self.app(scope, receive, watched)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.error is None


def uvicorn_config(settings: Settings, app: Any, tls: dict[str, Any] | None = None) -> Any:
    """The server's settings (a seam for timeouts and limits); ``tls``: uvicorn's
    ``ssl_*`` options."""
    import uvicorn

    from kernelhub.gateway.connections import fit_descriptor_limit, http_protocol
    from kernelhub.gateway.ws_protocol import websocket_protocol

    gateway = settings.gateway
    connections = fit_descriptor_limit(gateway.max_connections)
    return uvicorn.Config(
        app,
        host=gateway.host,
        port=gateway.port,
        log_level="warning",
        lifespan="on",
        ws_max_size=4 * 2**20,
        ws_per_message_deflate=gateway.ws_compression,
        ws=websocket_protocol(gateway.stream_stall_timeout, gateway.stream_buffer_bytes),
        http=http_protocol(
            connections, gateway.header_timeout, gateway.body_timeout, gateway.http_parser
        ),
        limit_concurrency=connections,
        **(tls or {}),
    )


def listen_socket(host: str, port: int) -> socket.socket:
    """The gateway's socket, bound before anything starts: a port in use is one line
    before any sandbox or token exists, not a log line after the lifespan ran."""
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets
    # whose proto says TCP. With proto 0 every REST response that left in two writes
    # waited for the client's delayed ACK: 48 ms a back-to-back `1+1` against 16 ms.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another port with "
            "--port or KERNELHUB_GATEWAY__PORT (or --host / KERNELHUB_GATEWAY__HOST)"
        ) from exc
    return sock


async def run_gateway(
    settings: Settings,
    sock: socket.socket,
    app_factory: Callable[[Settings], Any] | None = None,
    *,
    tls: dict[str, Any] | None = None,
    announce: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """Serve ``app_factory(settings)`` (the gateway app by default) on ``sock`` until
    stopped. A kernelhub error in the app's startup is raised as itself, not logged with
    its traceback."""
    import uvicorn

    if app_factory is None:
        from kernelhub.gateway.app import create_app

        app_factory = create_app

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            # ``started``: the lifespan (backend, store, manager) is up and the socket is
            # listening. Only then does the gateway really serve, and a token is worth making.
            if self.started:
                await (announce() if announce is not None else _announce(settings, tls))

    watch = _StartupWatch(app_factory(settings))
    server = Server(uvicorn_config(settings, watch, tls))
    logging.getLogger("uvicorn.error").addFilter(watch.filter)
    with contextlib.suppress(SystemExit):  # uvicorn's way out of a failed startup
        await server.serve(sockets=[sock])
    if watch.error is not None:
        raise watch.error
    if not server.started:
        raise BackendUnavailableError("the gateway did not start; the lines above say why")
    return 0


async def _announce(settings: Settings, tls: dict[str, Any] | None = None) -> None:
    gw = settings.gateway
    if tls:  # a node agent: its clients are the cluster's gateways
        print(f"kernelhub node {settings.store.node} on https://{gw.host}:{gw.port} (mutual TLS)")
    else:
        print(f"kernelhub gateway on http://{gw.host}:{gw.port} (data in {settings.data_dir})")
        print(f"review page: http://{gw.host}:{gw.port}/ (sign in with a token)")
    first = await bootstrap_token(settings)
    if first:
        print(f"no tokens existed; created admin token 'admin' (shown once): {first}")
    else:
        print(
            "tokens exist already, so none is shown; make another with "
            "`kernelhub token create --admin --name NAME`"
        )
    sys.stdout.flush()


async def bootstrap_token(settings: Settings) -> str | None:
    """The first admin token, when the store has none; None otherwise (also when another
    process sharing the store, a node agent starting beside this one, made it first)."""
    from kernelhub.errors import StoreConflictError
    from kernelhub.store import open_store

    store = await open_store(settings)
    try:
        if await store.list_tokens():
            return None
        return await store.create_token("admin", admin=True)
    except StoreConflictError:
        return None
    finally:
        await store.close()
