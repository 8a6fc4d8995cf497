"""The local backend: the kernel as a host process, for development and Docker-less machines.

With bubblewrap (``bwrap``) the kernel runs in new user, pid, network, ipc and mount
namespaces, sees a read-only view of the system directories it needs and nothing of the
host's home or data directories, gets its own ``/workspace`` and ``/tmp``, and runs under
kernelhub's seccomp profile. Without bwrap it refuses to start unless the operator chose
the explicit unisolated mode, which warns at every start.

Memory, CPU and pids limits are *not* enforced here (no cgroups); use the docker backend
for untrusted code.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import psutil

from kernelhub.errors import BackendUnavailableError, SandboxError
from kernelhub.image import CONNECTION_FILE, IPC_DIR, WORKSPACE
from kernelhub.image.build import kernel_image_dir
from kernelhub.kernel.connection import SOCKET_PREFIX, SessionDir
from kernelhub.models import ResourceUsage
from kernelhub.sandbox.base import (
    ExitInfo,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
    reap_directories,
)
from kernelhub.sandbox.exit import describe_exit
from kernelhub.sandbox.files import FILES_CWD, file_error, pump_upload
from kernelhub.sandbox.hostdirs import mount_tmpfs
from kernelhub.sandbox.seccomp import compile_bpf
from kernelhub.sandbox.state import SANDBOX_PATH as STATE_PATH
from kernelhub.sandbox.state import drop_state_dir, ensure_state_dir, spool_bytes, state_dir

# System paths the kernel may read. Home directories, /root, /srv, /var and kernelhub's own
# data directory are not among them.
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/opt")
_ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/localtime",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/fonts",
    "/etc/mime.types",
)


class UnisolatedWarning(UserWarning):
    """The local backend is running kernels without any isolation."""


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


class LocalBackend(SandboxBackend):
    name = "local"

    def __init__(
        self,
        *,
        run_dir: Path,
        instance: str = "default",
        unisolated: bool = False,
        bwrap: str | Literal["auto"] | None = "auto",
        gateway_id: str = "",
    ) -> None:
        """``bwrap``: the bubblewrap binary; ``"auto"`` looks it up on PATH, None means
        there is none. ``gateway_id``: as for the docker backend, what the reaper keeps to."""
        self.bwrap = bwrap_path() if bwrap == "auto" else bwrap
        if self.bwrap is None and not unisolated:
            raise BackendUnavailableError(
                "the local backend needs bubblewrap for isolation: `apt-get install -y "
                "bubblewrap`; or set KERNELHUB_LOCAL__UNISOLATED=true to run kernels as plain "
                "host processes (unsafe: the code can read and write your files)"
            )
        self.unisolated = self.bwrap is None
        self.instance = instance
        self.gateway_id = gateway_id
        self.run_dir = run_dir / instance
        self._bpf: Path | None = None
        self._live: set[str] = set()

    def _seccomp_program(self) -> Path:
        if self._bpf is None:
            self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
            fd, name = tempfile.mkstemp(prefix=".seccomp-", suffix=".bpf", dir=self.run_dir)
            with os.fdopen(fd, "wb") as fh:
                compile_bpf(fh)
            self._bpf = Path(name)
        return self._bpf

    async def create(self, spec: SandboxSpec) -> Sandbox:
        if self.unisolated:
            warnings.warn(
                "kernelhub local backend: bubblewrap is missing and unisolated mode is on; "
                "kernel code runs with your user's full access",
                UnisolatedWarning,
                stacklevel=2,
            )
        return LocalSandbox(self, spec)

    async def reap_orphans(self) -> int:
        removed = 0
        marker = str(self.run_dir) + os.sep
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info.get("cmdline") or []
            if "kernelhub_kernel.supervisor" in cmd and any(
                a.startswith(marker) and a.split(os.sep)[len(self.run_dir.parts)] not in self._live
                for a in cmd
            ):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
                    removed += 1
        reap_directories(self.run_dir, self.instance, self.gateway_id, self._live)
        return removed

    async def drop_state(self, session_id: str) -> None:
        drop_state_dir(state_dir(self.run_dir, session_id))

    async def close(self) -> None:
        if self._bpf is not None:
            self._bpf.unlink(missing_ok=True)


class LocalSandbox(Sandbox):
    def __init__(self, backend: LocalBackend, spec: SandboxSpec) -> None:
        self.backend = backend
        self.spec = spec
        self.proc: asyncio.subprocess.Process | None = None
        self._supervisor: psutil.Process | None = None
        self._peak = 0
        isolated = not backend.unisolated
        self.session_dir = SessionDir.create(
            backend.run_dir / spec.session_id,
            sandbox_uid=os.geteuid(),
            sandbox_gid=os.getegid(),
            labels=spec.labels(backend.instance, backend.gateway_id),
            kernel_ipc_prefix=f"{IPC_DIR}/{SOCKET_PREFIX}" if isolated else None,
        )
        # As root: sockets only, no room for data on the host (see the docker backend).
        mount_tmpfs(
            self.session_dir.ipc_dir,
            size_bytes=1024 * 1024,
            inodes=64,
            uid=os.geteuid(),
            gid=os.getegid(),
        )
        self._workspace = self.session_dir.root / "workspace"
        self._workspace.mkdir(mode=0o700)
        # Where the kernel writes snapshots and checkpoints (its /tmp/.kernelhub): on the
        # host, outliving this sandbox (see sandbox/state.py).
        self._snapshots = state_dir(backend.run_dir, spec.session_id)
        ensure_state_dir(
            self._snapshots,
            uid=os.geteuid(),
            gid=os.getegid(),
            size_bytes=spec.limits.tmp_bytes,
            labels=spec.labels(backend.instance, backend.gateway_id),
        )
        backend._live.add(spec.session_id)

    @property
    def id(self) -> str:
        return str(self.proc.pid) if self.proc else ""

    @property
    def workspace(self) -> Path:
        return self._workspace

    def _env(self, tmp: str) -> dict[str, str]:
        return {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": WORKSPACE if not self.backend.unisolated else str(self._workspace),
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(kernel_image_dir()),
            "PYTHONDONTWRITEBYTECODE": "1",
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
            "MPLCONFIGDIR": f"{tmp}/.matplotlib",
            "IPYTHONDIR": f"{tmp}/.ipython",
            "KERNELHUB_SESSION": self.spec.session_id,
            "KERNELHUB_SPOOL_BYTES": str(spool_bytes(self.spec.limits.output_bytes)),
            "KERNELHUB_SNAPSHOTS": STATE_PATH
            if not self.backend.unisolated
            else str(self._snapshots),
        }

    async def start(self) -> None:
        b = self.backend
        python = sys.executable
        if b.unisolated:
            tmp = str(self.session_dir.root / "tmp")
            os.mkdir(tmp, 0o700)
            cmd = [
                python,
                "-m",
                "kernelhub_kernel.supervisor",
                "--connection-file",
                str(self.session_dir.connection_file),
            ]
            self.proc = await asyncio.create_subprocess_exec(
                *cmd,
                env=self._env(tmp),
                cwd=self._workspace,
                start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
        else:
            bpf_fd = os.open(b._seccomp_program(), os.O_RDONLY)
            try:
                cmd = self._bwrap_command(python, bpf_fd)
                self.proc = await asyncio.create_subprocess_exec(
                    *cmd,
                    env={},
                    pass_fds=(bpf_fd,),
                    start_new_session=True,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                )
            finally:
                os.close(bpf_fd)
        self._stderr_tail = bytearray()
        self._stderr_task = asyncio.create_task(self._drain_stderr())

    def _bwrap_command(self, python: str, bpf_fd: int) -> list[str]:
        assert self.backend.bwrap is not None
        cmd = [
            self.backend.bwrap,
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--as-pid-1",
            "--hostname", "sandbox",
        ]  # fmt: skip
        for path in _SYSTEM_DIRS:
            cmd += ["--ro-bind-try", path, path]
        for path in _ETC_FILES:
            cmd += ["--ro-bind-try", path, path]
        # A private /tmp first: the binds below may live under the host's /tmp (a checkout
        # there), and a later mount hides an earlier one.
        cmd += ["--tmpfs", "/tmp"]
        # The interpreter and its packages, wherever they live (a venv under /root, pyenv …).
        for path in sorted(
            {sys.prefix, sys.base_prefix, str(Path(python).resolve().parent.parent)}
        ):
            cmd += ["--ro-bind", path, path]
        kdir = str(kernel_image_dir())
        cmd += [
            "--ro-bind", kdir, kdir,
            "--proc", "/proc",
            "--dev", "/dev",
            "--bind", str(self._workspace), WORKSPACE,
            "--bind", str(self._snapshots), STATE_PATH,
            "--bind", str(self.session_dir.ipc_dir), IPC_DIR,
            "--ro-bind", str(self.session_dir.connection_file), CONNECTION_FILE,
            "--chdir", WORKSPACE,
            "--seccomp", str(bpf_fd),
        ]  # fmt: skip
        for key, value in self._env("/tmp").items():
            cmd += ["--setenv", key, value]
        cmd += [
            "--",
            python,
            "-m",
            "kernelhub_kernel.supervisor",
            "--connection-file",
            CONNECTION_FILE,
        ]
        return cmd

    async def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(65536):
            self._stderr_tail += chunk
            del self._stderr_tail[:-8192]

    async def log_tail(self, lines: int = 30) -> str:
        text = bytes(getattr(self, "_stderr_tail", b"")).decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def _find_supervisor(self) -> psutil.Process | None:
        if self._supervisor is not None and self._supervisor.is_running():
            return self._supervisor
        if self.proc is None:
            return None
        try:
            root = psutil.Process(self.proc.pid)
            for proc in [root, *root.children(recursive=True)]:
                # bwrap's own command line names the supervisor too; match the python one.
                if proc.cmdline()[1:3] == ["-m", "kernelhub_kernel.supervisor"]:
                    self._supervisor = proc
                    return proc
        except psutil.Error:
            return None
        return None

    async def _signal(self, sig: signal.Signals) -> None:
        sup = self._find_supervisor()
        if sup is None:
            if self.proc is not None and self.proc.returncode is None:
                raise SandboxError("the sandbox's supervisor process cannot be found")
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            sup.send_signal(sig)

    async def wait_exit(self) -> ExitInfo:
        assert self.proc is not None
        code = await asyncio.shield(self.proc.wait())
        return describe_exit(code)

    async def interrupt(self) -> None:
        await self._signal(signal.SIGINT)

    def _tree(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    async def pause(self) -> None:
        # No freezer without cgroups: SIGSTOP every process of the sandbox, children first
        # so none can react to its parent stopping.
        for proc in reversed(self._tree()):
            with contextlib.suppress(psutil.Error):
                proc.suspend()

    async def resume(self) -> None:
        for proc in self._tree():
            with contextlib.suppress(psutil.Error):
                proc.resume()

    async def restart_kernel(self) -> None:
        await self._signal(signal.SIGHUP)

    async def kill(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()

    async def remove(self, *, keep_state: bool = False) -> None:
        await self.kill()
        task = getattr(self, "_stderr_task", None)
        if task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 1.0)
        self.backend._live.discard(self.spec.session_id)
        self.session_dir.remove()
        if not keep_state:
            drop_state_dir(self._snapshots)

    async def _files(self, verb: str, path: str, max_bytes: int) -> asyncio.subprocess.Process:
        # The workspace is a host directory here; the same program that guards it inside a
        # container walks it beneath the workspace root, refusing symlinks.
        program = kernel_image_dir() / "kernelhub_kernel" / "files.py"
        return await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", str(program), verb, path, str(max_bytes),
            cwd=FILES_CWD,
            env={
                "KERNELHUB_WORKSPACE": str(self._workspace),
                "KERNELHUB_SNAPSHOTS": str(self._snapshots),
            },
            stdin=asyncio.subprocess.PIPE if verb in ("put", "unpack") else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if verb in ("get", "pack") else asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip

    async def _stream_in(
        self, verb: str, arg: str, chunks: AsyncIterator[bytes], max_bytes: int
    ) -> int:
        proc = await self._files(verb, arg, max_bytes)
        assert proc.stdin is not None and proc.stderr is not None

        async def write(chunk: bytes) -> None:
            assert proc.stdin is not None
            proc.stdin.write(chunk)
            await proc.stdin.drain()

        try:
            total = await pump_upload(chunks, write, max_bytes)
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        proc.stdin.close()
        stderr = await proc.stderr.read()
        error = file_error(await proc.wait(), stderr.decode("utf-8", "replace"))
        if error is not None:
            raise error
        return total

    async def _stream_out(self, verb: str, arg: str, max_bytes: int) -> AsyncIterator[bytes]:
        proc = await self._files(verb, arg, max_bytes)
        assert proc.stdout is not None and proc.stderr is not None
        try:
            while chunk := await proc.stdout.read(65536):
                yield chunk
            stderr = await proc.stderr.read()
            error = file_error(await proc.wait(), stderr.decode("utf-8", "replace"))
            if error is not None:
                raise error
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    def usage(self) -> ResourceUsage:
        sup = self._find_supervisor()
        if sup is None:
            return ResourceUsage()
        cpu = 0.0
        rss = 0
        try:
            for proc in [sup, *sup.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = proc.cpu_times()
                    cpu += times.user + times.system + times.children_user + times.children_system
                    rss += proc.memory_info().rss
        except psutil.Error:
            return ResourceUsage()
        self._peak = max(self._peak, rss)
        return ResourceUsage(cpu_seconds=cpu, memory_bytes=rss, peak_memory_bytes=self._peak)

    def reset_peak(self) -> None:
        self._peak = 0
