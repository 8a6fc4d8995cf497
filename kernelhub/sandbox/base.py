"""The one seam between kernelhub and whatever isolates a kernel.

A :class:`SandboxBackend` makes :class:`Sandbox` objects; a ``KernelSession`` (the engine)
owns exactly one sandbox and is the only caller of its methods. The session layer needs
some of them too (the death watch, files, usage, moving snapshots in and out): it calls
the engine's delegating methods of the same names, never the sandbox. Implementations:
``docker.DockerBackend`` (the default, one hardened container per sandbox) and
``local.LocalBackend`` (a host process, in bubblewrap namespaces when available).

Inside every sandbox the same program runs: ``kernelhub_kernel.supervisor`` from
``kernel-image/``, which starts the IPython kernel, forwards SIGINT to it (interrupt),
restarts it on SIGHUP, and exits with the kernel's status when the kernel dies.
"""

from __future__ import annotations

import abc
import json
from collections.abc import AsyncIterator, Collection
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from kernelhub import __version__
from kernelhub.config import Limits
from kernelhub.kernel.connection import SessionDir
from kernelhub.models import ResourceUsage
from kernelhub.sandbox.files import capped, checked_path

LABEL_PREFIX = "org.kernelhub"
LABEL_MANAGED = f"{LABEL_PREFIX}.managed"
LABEL_SESSION = f"{LABEL_PREFIX}.session"
LABEL_OWNER = f"{LABEL_PREFIX}.owner"
LABEL_VERSION = f"{LABEL_PREFIX}.version"
LABEL_INSTANCE = f"{LABEL_PREFIX}.instance"
#: The gateway's identity (``kernelhub.datadir``): its reaper removes only what carries it.
LABEL_GATEWAY = f"{LABEL_PREFIX}.gateway"


class SandboxSpec(BaseModel):
    """What to create. Everything a backend needs to know about one sandbox."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str = Field(pattern=r"^[a-z0-9]{6,32}$")
    owner: str = "local"
    limits: Limits = Field(default_factory=Limits)
    runtime: str | None = Field(
        None, description="the OCI runtime (a trust tier's: runsc); None: the backend's"
    )

    def labels(self, instance: str, gateway: str = "") -> dict[str, str]:
        """Labels every resource made for this sandbox carries; cleanup finds them by these."""
        return {
            LABEL_MANAGED: "true",
            LABEL_SESSION: self.session_id,
            LABEL_OWNER: self.owner,
            LABEL_VERSION: __version__,
            LABEL_INSTANCE: instance,
            LABEL_GATEWAY: gateway,
        }


def made_by(labels: dict[str, str], instance: str, gateway: str) -> bool:
    """Whether a resource with ``labels`` was made by the backend of this instance and
    gateway identity (resources from before identities carry none: they match ``""``)."""
    return labels.get(LABEL_INSTANCE) == instance and labels.get(LABEL_GATEWAY, "") == gateway


def reap_directories(run_dir: Path, instance: str, gateway: str, live: Collection[str]) -> None:
    """Remove the socket and state directories under ``run_dir`` (one instance's) that
    this gateway made (by their host-only labels) and no live sandbox of ``live`` owns.
    Unlabelled ones, and another gateway's, are never touched."""
    from kernelhub.sandbox.state import drop_state_dir, state_labels

    if not run_dir.is_dir():
        return
    for child in run_dir.iterdir():
        if child.name.endswith(".state"):
            session = child.name[: -len(".state")]
            try:
                labels = json.loads(state_labels(child).read_text())
            except (OSError, ValueError):
                continue
            mine = isinstance(labels, dict) and made_by(labels, instance, gateway)
            if mine and session not in live:
                drop_state_dir(child)
        elif (
            child.name not in live
            and child.is_dir()
            and not child.is_symlink()
            and made_by(SessionDir.read_labels(child), instance, gateway)
        ):
            SessionDir.remove_root(child)


class ExitInfo(BaseModel):
    """How a sandbox's kernel ended."""

    model_config = ConfigDict(frozen=True)

    exit_code: int | None = None
    oom_killed: bool = False
    reason: str


class Sandbox(abc.ABC):
    """One running kernel's isolation. Method contracts (caller: the owning engine):

    - ``start()``: launch; returns once the process runs (the kernel may not be ready:
      the engine waits for its sockets in ``session_dir`` and asks for ``kernel_info``).
    - ``started()``: awaited by the engine once the kernel answers, before the first
      ``usage()``: finishes what ``start()`` left running beside the kernel's start (the
      docker backend's inspect for the cgroup). Returns at once if the sandbox was removed.
    - ``wait_exit()``: resolves with :class:`ExitInfo` when the kernel is gone for good
      (not on a requested ``restart_kernel``). Safe to await from several tasks.
    - ``interrupt()``: deliver SIGINT to the running cell (the supervisor forwards it).
    - ``restart_kernel()``: replace the kernel process, keeping the sandbox and its files;
      the engine then reconnects. Variables are lost.
    - ``kill()``: stop everything now; ``wait_exit`` resolves.
    - ``remove()``: release every resource (container, directories). Idempotent.
    - ``usage()`` / ``reset_peak()``: accounting, cheap enough to call around every cell.
    - ``pause()`` / ``resume()``: freeze and thaw the whole sandbox.
    - ``write_file()`` / ``read_file()``: bytes in and out of ``/workspace``.
    """

    session_dir: SessionDir
    spec: SandboxSpec

    @property
    @abc.abstractmethod
    def id(self) -> str:
        """Backend-specific id (container id, or process id)."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    async def started(self) -> None:
        return None

    @abc.abstractmethod
    async def wait_exit(self) -> ExitInfo: ...

    @abc.abstractmethod
    async def interrupt(self) -> None: ...

    @abc.abstractmethod
    async def restart_kernel(self) -> None: ...

    @abc.abstractmethod
    async def kill(self) -> None: ...

    @abc.abstractmethod
    async def remove(self, *, keep_state: bool = False) -> None:
        """``keep_state``: leave the state directory (checkpoints) for a successor
        sandbox of the same session — crash recovery."""

    @abc.abstractmethod
    def usage(self) -> ResourceUsage: ...

    @abc.abstractmethod
    def reset_peak(self) -> None: ...

    @abc.abstractmethod
    async def pause(self) -> None:
        """Freeze every process of the sandbox (no CPU, no signals handled) until
        ``resume``. The engine sends nothing to a paused sandbox."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    async def write_file(self, path: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Write ``chunks`` to ``/workspace/<path>`` (parents created); returns the size.
        Refuses ``..``, absolute paths, NULs, over-long paths and symlinks with
        ``InvalidRequestError``."""
        return await self._stream_in("put", checked_path("put", path), chunks, max_bytes)

    def read_file(self, path: str, max_bytes: int) -> AsyncIterator[bytes]:
        """Stream ``/workspace/<path>``; ``NotFoundError`` if missing, ``TooLargeError``
        over ``max_bytes`` (counted here, whatever the sandbox says), ``InvalidRequestError``
        for a malformed path (at once) or what is not a regular file; never follows a
        symlink."""
        chunks = self._stream_out("get", checked_path("get", path), max_bytes)
        return capped(chunks, max_bytes, f"file {path!r}")

    def pack_snapshot(self, name: str, max_bytes: int) -> AsyncIterator[bytes]:
        """Stream the snapshot directory ``name`` the kernel wrote, as an opaque tar."""
        chunks = self._stream_out("pack", checked_path("pack", name), max_bytes)
        return capped(
            chunks, max_bytes, f"snapshot {name!r}", "KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES"
        )

    async def unpack_snapshot(self, name: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Put an opaque snapshot tar back into the sandbox as directory ``name``."""
        return await self._stream_in("unpack", checked_path("unpack", name), chunks, max_bytes)

    @abc.abstractmethod
    async def _stream_in(
        self, verb: str, arg: str, chunks: AsyncIterator[bytes], max_bytes: int
    ) -> int:
        """Run ``kernelhub_kernel.files <verb> <arg>`` in the sandbox, feeding it ``chunks``."""

    @abc.abstractmethod
    def _stream_out(self, verb: str, arg: str, max_bytes: int) -> AsyncIterator[bytes]:
        """Run ``kernelhub_kernel.files <verb> <arg>`` in the sandbox, streaming its output;
        its refusal (bad path, missing, too large) raises once the output ends."""

    async def log_tail(self, lines: int = 30) -> str:
        """The last lines the sandbox wrote outside the kernel protocol (diagnostics)."""
        return ""

    @property
    def workspace(self) -> Path | None:
        """Host path of the workspace, where the backend has one (local backend only)."""
        return None


class SandboxBackend(abc.ABC):
    """Makes sandboxes of one kind. Callers: the session layer (create), start-up (reap)."""

    name: str

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Prepare a sandbox (not started)."""

    async def adopt(self, spec: SandboxSpec) -> Sandbox | None:
        """Find the still-running sandbox of ``spec.session_id`` left by a previous
        kernelhub process with the same instance label, or None if it is gone (or this
        backend's sandboxes cannot outlive their creator)."""
        return None

    async def runtimes(self) -> frozenset[str]:
        """The OCI runtimes a sandbox of this backend may ask for (``SandboxSpec.runtime``:
        a trust tier's isolation); none by default."""
        return frozenset()

    async def drop_state(self, session_id: str) -> None:  # noqa: B027 - optional
        """Remove the session's state directory (its snapshots and checkpoints): when the
        session is deleted, or dead for good."""

    @abc.abstractmethod
    async def reap_orphans(self) -> int:
        """Remove every resource this backend instance's labels mark that no live sandbox
        owns (left by a crashed kernelhub). Only what carries this backend's instance and
        gateway identity: never another gateway's. Returns how many were removed."""

    def check_host(self) -> None:  # noqa: B027 - optional
        """Called once by ``serve`` before any sandbox starts: raise ``ConfigError`` if
        this host cannot keep sandboxes inside their bounds (the calling contract of a
        backend whose host-side resources depend on the deployment)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, most backends need it
        """Release the backend's own resources (clients, threads)."""
