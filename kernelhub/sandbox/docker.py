"""The docker backend: one hardened container per sandbox, through the Docker Engine API.

The docker SDK is synchronous; its calls run on a small thread pool this backend owns.
One thread follows the daemon's event stream for our containers and resolves each
sandbox's exit future the moment its container dies, so a dead kernel is noticed within
milliseconds without polling or a thread per sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions

from kernelhub.config import EgressSettings
from kernelhub.errors import BackendUnavailableError, ConfigError, ImageError, SandboxError
from kernelhub.image import IPC_DIR, KERNEL_PYTHON, SANDBOX_GID, SANDBOX_UID
from kernelhub.image.build import check_image
from kernelhub.kernel.connection import SOCKET_PREFIX, SessionDir
from kernelhub.models import ResourceUsage
from kernelhub.sandbox.base import (
    LABEL_INSTANCE,
    LABEL_MANAGED,
    ExitInfo,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
    made_by,
    reap_directories,
)
from kernelhub.sandbox.cgroup import CgroupFiles
from kernelhub.sandbox.docker_config import container_config, create_args
from kernelhub.sandbox.exit import describe_exit
from kernelhub.sandbox.files import (
    FILES_CWD,
    FILES_PROGRAM,
    demux,
    file_error,
    pump_upload,
)
from kernelhub.sandbox.hostdirs import can_mount_tmpfs, mount_tmpfs, uncapped_run_dir
from kernelhub.sandbox.seccomp import profile_json
from kernelhub.sandbox.state import drop_state_dir, ensure_state_dir, state_dir

log = logging.getLogger(__name__)
T = TypeVar("T")
# The socket directory holds five sockets (no data blocks); room for a few more inodes.
IPC_TMPFS_BYTES = 1024 * 1024
IPC_TMPFS_INODES = 64

_DOCKER_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)


def docker_available(base_url: str | None = None) -> bool:
    """Does a Docker daemon answer? (Used by backend ``auto``.)"""
    try:
        client = _client(base_url, timeout=3)
        try:
            client.ping()
        finally:
            client.close()
        return True
    except _DOCKER_ERRORS:
        return False


def _client(base_url: str | None, timeout: int = 120) -> docker.DockerClient:
    if base_url:
        return docker.DockerClient(base_url=base_url, timeout=timeout)
    return docker.from_env(timeout=timeout)


class DockerBackend(SandboxBackend):
    name = "docker"

    def __init__(
        self,
        *,
        image: str,
        run_dir: Path,
        instance: str = "default",
        runtime: str = "runc",
        base_url: str | None = None,
        gateway_id: str = "",
        egress: EgressSettings | None = None,
        run_dir_max_bytes: int | None = None,
    ) -> None:
        """``gateway_id``: the identity of the gateway this backend serves (see
        ``kernelhub.datadir``); its reaper removes only sandboxes labelled with it.
        ``egress``: give sandboxes the egress proxy's port (the gateway serves it).
        ``run_dir_max_bytes``: see :meth:`check_host`."""
        self.run_dir_max_bytes = run_dir_max_bytes
        try:
            self.client = _client(base_url)
            self.client.ping()
        except _DOCKER_ERRORS as exc:
            raise BackendUnavailableError(
                f"no Docker daemon answers ({exc}); start dockerd, set DOCKER_HOST, "
                "or use KERNELHUB_BACKEND=local"
            ) from exc
        self.image = image
        self.egress = egress
        self.runtime = runtime
        self.instance = instance
        self.gateway_id = gateway_id
        self.run_dir = run_dir / instance
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kernelhub-docker")
        self._seccomp = profile_json()
        self._image_checked = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exits: dict[str, asyncio.Future[ExitInfo]] = {}
        self._ooms: set[str] = set()
        self._events: Any = None
        self._events_thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._runtimes: dict[str, str] = {}  # session id -> its trust tier's runtime
        self._known_runtimes: frozenset[str] | None = None

    def check_host(self) -> None:
        """Refuse a run directory sandboxes could fill: where socket directories cannot
        be capped tmpfs mounts of their own, its filesystem must be small
        (KERNELHUB_DOCKER__RUN_DIR_MAX_BYTES)."""
        if self.run_dir_max_bytes is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(self.run_dir)
        problem = uncapped_run_dir(
            self.run_dir,
            can_mount=can_mount_tmpfs(self.run_dir),
            filesystem_bytes=st.f_blocks * st.f_frsize,
            max_bytes=self.run_dir_max_bytes,
        )
        if problem is not None:
            raise ConfigError(problem)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking docker SDK call on our pool, translating its errors."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        except docker.errors.ImageNotFound as exc:
            raise ImageError(
                f"kernel image {self.image} not found; build it with `kernelhub image build`"
            ) from exc
        except _DOCKER_ERRORS as exc:
            raise SandboxError(f"Docker call {getattr(fn, '__name__', fn)} failed: {exc}") from exc

    async def _ensure_started(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._events = self.client.events(
                decode=True,
                filters={
                    "type": "container",
                    "event": ["die", "oom"],
                    "label": [f"{LABEL_MANAGED}=true", f"{LABEL_INSTANCE}={self.instance}"],
                },
            )
            self._events_thread = threading.Thread(
                target=self._follow_events, name="kernelhub-docker-events", daemon=True
            )
            self._events_thread.start()
        if not self._image_checked:
            await self.call(check_image, self.client, self.image)
            self._image_checked = True

    def _follow_events(self) -> None:
        try:
            for event in self._events:
                cid = event.get("id") or event.get("Actor", {}).get("ID")
                action = event.get("Action") or event.get("status")
                if not cid or self._loop is None:
                    continue
                if action == "oom":
                    self._ooms.add(cid)
                elif action == "die":
                    self._loop.call_soon_threadsafe(self._on_die, cid, event)
        except Exception:  # the stream closes with an error when we close the client
            log.debug("docker event stream ended", exc_info=True)

    def _on_die(self, cid: str, event: dict[str, Any]) -> None:
        fut = self._exits.get(cid)
        if fut is None or fut.done():
            return
        attrs = event.get("Actor", {}).get("Attributes", {})
        try:
            code: int | None = int(attrs.get("exitCode"))
        except (TypeError, ValueError):
            code = None
        task = asyncio.ensure_future(self._settle_exit(cid, code, fut))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle_exit(self, cid: str, code: int | None, fut: asyncio.Future[ExitInfo]) -> None:
        oom = cid in self._ooms
        if not oom:
            # The "oom" event can trail "die"; the container state is authoritative.
            with contextlib.suppress(SandboxError, ImageError):
                attrs = await self.call(self.client.api.inspect_container, cid)
                oom = bool(attrs.get("State", {}).get("OOMKilled"))
        if not fut.done():
            fut.set_result(ExitInfo(exit_code=code, oom_killed=oom, reason=""))

    async def create(self, spec: SandboxSpec) -> Sandbox:
        await self._ensure_started()
        # A session's trust tier outlives its sandboxes: the one made for a recovery or a
        # wake-up (whose spec names no runtime) keeps the runtime its first one had.
        if spec.runtime is not None:
            self._runtimes[spec.session_id] = spec.runtime
        elif spec.session_id in self._runtimes:
            spec = spec.model_copy(update={"runtime": self._runtimes[spec.session_id]})
        return DockerSandbox(self, spec)

    async def runtimes(self) -> frozenset[str]:
        if self._known_runtimes is None:
            info = await self.call(self.client.info)
            self._known_runtimes = frozenset(info.get("Runtimes") or {}) | {self.runtime}
        return self._known_runtimes

    async def adopt(self, spec: SandboxSpec) -> Sandbox | None:
        await self._ensure_started()
        containers = await self.call(
            self.client.containers.list,
            all=True,
            filters={
                "label": [
                    f"{LABEL_MANAGED}=true",
                    f"{LABEL_INSTANCE}={self.instance}",
                    f"org.kernelhub.session={spec.session_id}",
                ]
            },
        )
        containers = [c for c in containers if self._ours(c)]
        root = self.run_dir / spec.session_id
        if len(containers) != 1 or not (root / "kernel.json").is_file():
            return None
        sandbox = DockerSandbox(self, spec, existing=containers[0])
        self._exits[containers[0].id] = sandbox._exit
        await self.call(containers[0].reload)
        runtime = (containers[0].attrs.get("HostConfig") or {}).get("Runtime")
        if runtime and runtime != self.runtime:
            self._runtimes[spec.session_id] = runtime
        if containers[0].status != "running":
            await sandbox.remove()
            return None
        sandbox._load_cgroup()
        return sandbox

    async def reap_orphans(self) -> int:
        await self._ensure_started()
        containers = await self.call(
            self.client.containers.list,
            all=True,
            filters={"label": [f"{LABEL_MANAGED}=true", f"{LABEL_INSTANCE}={self.instance}"]},
        )
        # Another gateway's sandboxes (another data directory, same instance name) are
        # not orphans, however they look from here.
        containers = [c for c in containers if self._ours(c)]
        live = {cid for cid, fut in self._exits.items() if not fut.done()}
        removed = 0
        for container in containers:
            if container.id in live:
                continue
            with contextlib.suppress(SandboxError):
                await self.call(container.remove, force=True)
                removed += 1
        # Directories left behind by sandboxes no container answers for any more.
        owned = {c.labels.get("org.kernelhub.session", "") for c in containers if c.id in live}
        reap_directories(self.run_dir, self.instance, self.gateway_id, owned)
        return removed

    def _ours(self, container: Any) -> bool:
        return made_by(container.labels, self.instance, self.gateway_id)

    async def drop_state(self, session_id: str) -> None:
        drop_state_dir(state_dir(self.run_dir, session_id))

    async def close(self) -> None:
        if self._events is not None:
            with contextlib.suppress(Exception):
                self._events.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            self.client.close()


class DockerSandbox(Sandbox):
    def __init__(self, backend: DockerBackend, spec: SandboxSpec, existing: Any = None) -> None:
        self.backend = backend
        self.spec = spec
        self.container: Any = existing
        self._cgroup: CgroupFiles | None = None
        # The inspect (for the cgroup) that runs while the kernel starts; see started().
        self._inspect: asyncio.Task[None] | None = None
        self._removed = False
        root = backend.run_dir / spec.session_id
        uid = SANDBOX_UID if _is_root() else _euid()
        gid = SANDBOX_GID if _is_root() else _egid()
        labels = spec.labels(backend.instance, backend.gateway_id)
        if existing is not None:
            # kernel.json sits outside ipc/ and is mounted read-only: the sandbox cannot
            # have changed it, so its key is still ours.
            self.session_dir = SessionDir.load(root, sandbox_uid=uid)
        else:
            self.session_dir = SessionDir.create(
                root,
                sandbox_uid=uid,
                sandbox_gid=gid,
                labels=labels,
                kernel_ipc_prefix=f"{IPC_DIR}/{SOCKET_PREFIX}",
            )
            # The kernel only binds its five sockets here: a tiny tmpfs, so it cannot store
            # data on the host's /run (where mounting is refused, a warning says so).
            mount_tmpfs(
                self.session_dir.ipc_dir,
                size_bytes=IPC_TMPFS_BYTES,
                inodes=IPC_TMPFS_INODES,
                uid=uid,
                gid=gid,
            )
        self.state_dir = state_dir(backend.run_dir, spec.session_id)
        self._state_on_host = ensure_state_dir(
            self.state_dir, uid=uid, gid=gid, size_bytes=spec.limits.tmp_bytes, labels=labels
        )
        if not self._state_on_host:
            # No capped host directory: never an uncapped one (see docker_config).
            drop_state_dir(self.state_dir)
        self._exit: asyncio.Future[ExitInfo] = asyncio.get_running_loop().create_future()

    @property
    def id(self) -> str:
        return str(self.container.id) if self.container is not None else ""

    async def start(self) -> None:
        b = self.backend
        config = container_config(
            self.spec,
            image=b.image,
            runtime=self.spec.runtime or b.runtime,
            session_dir=self.session_dir,
            instance=b.instance,
            seccomp_profile=b._seccomp,
            state_dir=self.state_dir if self._state_on_host else None,
            gateway=b.gateway_id,
            egress=b.egress,
        )
        if not _is_root():
            config["user"] = f"{_euid()}:{_egid()}"
        api = b.client.api
        try:
            cid = await self._create(create_args(config, api._version))
            await b.call(api.start, cid)
        except BaseException:
            await self.remove()
            raise
        # The pid, for the cgroup, while the kernel starts (the engine awaits started()).
        self._inspect = asyncio.create_task(self._find_cgroup(cid), name=f"inspect-{cid[:12]}")

    async def _create(self, args: dict[str, Any]) -> str:
        """Create the container; its id. Cancelled meanwhile, it still learns the id of
        what the daemon makes (so remove() takes it away) before it gives in."""
        b = self.backend
        call = asyncio.ensure_future(b.call(b.client.api.create_container, **args))
        try:
            created = await asyncio.shield(call)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                self._adopt_id(str((await call)["Id"]))
            raise
        return self._adopt_id(str(created["Id"]))

    def _adopt_id(self, cid: str) -> str:
        # A model on the id alone: what containers.create would have inspected for is
        # read once, after start (_find_cgroup).
        self.container = self.backend.client.containers.prepare_model({"Id": cid})
        self.backend._exits[cid] = self._exit
        return cid

    async def _find_cgroup(self, cid: str) -> None:
        b = self.backend
        try:
            attrs = await b.call(b.client.api.inspect_container, cid)
        except SandboxError as exc:
            if isinstance(exc.__cause__, docker.errors.NotFound):
                return  # removed meanwhile: nothing to account for
            raise
        if self._removed:
            return  # opened now, the cgroup's files would outlive the sandbox
        self.container.attrs = attrs
        self._load_cgroup()

    async def started(self) -> None:
        task = self._inspect
        if task is None:
            return
        await asyncio.wait([task])
        if task.cancelled():
            return  # by remove()
        task.result()

    async def _drop_inspect(self) -> None:
        task, self._inspect = self._inspect, None
        if task is None:
            return
        task.cancel()
        # wait() neither raises the task's error nor swallows our own cancellation.
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved: a failure that no longer matters

    def _load_cgroup(self) -> None:
        pid = self.container.attrs.get("State", {}).get("Pid")
        if pid:
            if self._cgroup is not None:
                self._cgroup.close()
            self._cgroup = CgroupFiles.for_pid(int(pid), must_contain=self.container.id)

    async def wait_exit(self) -> ExitInfo:
        info = await asyncio.shield(self._exit)
        if info.reason:
            return info
        return describe_exit(
            info.exit_code,
            oom_killed=info.oom_killed,
            memory_limit=self.spec.limits.memory_bytes,
        )

    async def _signal(self, sig: str) -> None:
        if self.container is None or self._exit.done():
            return
        try:
            await self.backend.call(self.container.kill, signal=sig)
        except SandboxError:
            if not self._exit.done():
                raise

    async def interrupt(self) -> None:
        await self._signal("SIGINT")

    async def pause(self) -> None:
        # The cgroup freezer: every process stops at once, threads and children included.
        await self.backend.call(self.container.pause)

    async def resume(self) -> None:
        await self.backend.call(self.container.unpause)

    async def restart_kernel(self) -> None:
        await self._signal("SIGHUP")

    async def kill(self) -> None:
        await self._signal("SIGKILL")

    async def remove(self, *, keep_state: bool = False) -> None:
        self._removed = True
        await self._drop_inspect()
        if self._cgroup is not None:
            self._cgroup.close()  # an open cgroup file keeps the dead cgroup around
        if self.container is not None:
            with contextlib.suppress(SandboxError):
                await self.backend.call(self.container.remove, force=True, v=True)
            self.backend._exits.pop(self.container.id, None)
            self.backend._ooms.discard(self.container.id)
        if not self._exit.done():
            self._exit.set_result(ExitInfo(reason="sandbox removed"))
        self.session_dir.remove()
        if not keep_state:
            drop_state_dir(self.state_dir)

    async def _exec_files(self, verb: str, path: str, max_bytes: int) -> tuple[str, Any]:
        """Start the files program in the container; returns the exec id and an asyncio
        stream pair on the attached socket."""
        api = self.backend.client.api
        command = [KERNEL_PYTHON, *FILES_PROGRAM, verb, path, str(max_bytes)]
        exec_id = (await self.backend.call(
            api.exec_create, self.container.id, command,
            stdin=verb in ("put", "unpack"), stdout=True, stderr=True, user=f"{SANDBOX_UID}:{SANDBOX_GID}",
            workdir=FILES_CWD,
        ))["Id"]  # fmt: skip
        raw = await self.backend.call(api.exec_start, exec_id, socket=True)
        # Take our own descriptor for asyncio and close the SDK's wrappers right away, so
        # exactly one owner closes each socket object.
        sock = socket.socket(fileno=os.dup(raw._sock.fileno()))
        raw._sock.close()
        raw.close()
        sock.setblocking(False)
        streams = await asyncio.open_unix_connection(sock=sock)
        return exec_id, streams

    async def _exec_result(
        self, exec_id: str, reader: asyncio.StreamReader, sink: Any = None
    ) -> None:
        """Read the multiplexed output to the end; stdout to ``sink``; raise on failure."""
        buffer = bytearray()
        stderr = bytearray()
        while data := await reader.read(65536):
            buffer += data
            for stream, payload in demux(buffer):
                if stream == 1 and sink is not None:
                    await sink(payload)
                elif stream == 2:
                    stderr += payload
                    del stderr[:-4096]
        info = await self.backend.call(self.backend.client.api.exec_inspect, exec_id)
        error = file_error(info.get("ExitCode"), stderr.decode("utf-8", "replace"))
        if error is not None:
            raise error

    async def _stream_in(
        self, verb: str, arg: str, chunks: AsyncIterator[bytes], max_bytes: int
    ) -> int:
        exec_id, (reader, writer) = await self._exec_files(verb, arg, max_bytes)

        async def write(chunk: bytes) -> None:
            writer.write(chunk)
            await writer.drain()

        try:
            total = await pump_upload(chunks, write, max_bytes)
            if writer.can_write_eof():
                writer.write_eof()
            await self._exec_result(exec_id, reader)
        finally:
            writer.close()
        return total

    async def _stream_out(self, verb: str, arg: str, max_bytes: int) -> AsyncIterator[bytes]:
        exec_id, (reader, writer) = await self._exec_files(verb, arg, max_bytes)
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=16)

        async def sink(payload: bytes) -> None:
            await queue.put(payload)

        async def run() -> None:
            try:
                await self._exec_result(exec_id, reader, sink)
            finally:
                await queue.put(None)

        task = asyncio.create_task(run())
        try:
            while (chunk := await queue.get()) is not None:
                yield chunk
            await task  # raises the program's refusal, if any
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            writer.close()

    def usage(self) -> ResourceUsage:
        return self._cgroup.read() if self._cgroup else ResourceUsage()

    def reset_peak(self) -> None:
        if self._cgroup:
            self._cgroup.reset_peak()

    async def log_tail(self, lines: int = 30) -> str:
        if self.container is None:
            return ""
        try:
            raw = await self.backend.call(self.container.logs, tail=lines)
        except SandboxError:
            return ""
        return bytes(raw).decode("utf-8", "replace")


def _is_root() -> bool:
    return os.geteuid() == 0


def _euid() -> int:
    return os.geteuid()


def _egid() -> int:
    return os.getegid()
