"""The standby sandbox of a hibernated session, and the capture it wakes from.

A session that hibernates keeps its last capture in its state directory, and an empty
sandbox for the same session starts at once (``KERNELHUB_GATEWAY__HIBERNATE_STANDBY``)
with the capture's top-level modules imported ahead: waking then only restores the
namespace into a kernel that is already up. Used by
:class:`~kernelhub.session.continuity.Continuity`.
"""

from __future__ import annotations

import contextlib
import logging
import time

from kernelhub.config import Settings
from kernelhub.errors import KernelhubError
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.base import SandboxBackend
from kernelhub.sandbox.state import state_dir
from kernelhub.session.live import LiveSession, start_kernel
from kernelhub.store.base import Store
from kernelhub.store.records import StoredSnapshot

log = logging.getLogger(__name__)


class Standby:
    """Starts, hands over and stops standby sandboxes (see the module)."""

    def __init__(self, settings: Settings, backend: SandboxBackend, store: Store) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store  # read only: where the session's numbering is

    async def start_kernel(
        self, live: LiveSession, modules: list[str] | None = None, *, first_seq: int | None = None
    ) -> KernelSession:
        """A fresh sandbox for the session; ``modules`` imported ahead (a standby's, for
        the restore: importing numpy and pandas is a good part of it)."""
        if first_seq is None:
            first_seq = await self.store.last_seq(live.id)
        kernel = await start_kernel(live, self.backend, self.settings.engine, first_seq)
        if modules:
            code = "".join(f"__import__({m!r})\n" for m in modules)
            with contextlib.suppress(KernelhubError):
                await kernel.call(code, {}, timeout=60)
        return kernel

    async def start(self, live: LiveSession, modules: list[str]) -> KernelSession:
        t0 = time.monotonic()
        kernel = await self.start_kernel(live, modules)
        log.info(
            "session %s: standby sandbox ready in %.2f s (imported %s)",
            live.id,
            time.monotonic() - t0,
            ", ".join(modules) or "nothing",
        )
        return kernel

    async def take(self, live: LiveSession) -> KernelSession | None:
        """The empty sandbox started when the session hibernated, if it came up and is
        still alive (waited for if it is still starting); None: start one now."""
        standby, live.standby = live.standby, None
        if standby is None:
            return None
        try:
            kernel = await standby
        except KernelhubError as exc:
            log.warning("session %s: its standby sandbox failed to start: %s", live.id, exc)
            return None
        if kernel.alive:
            return kernel
        await kernel.close(keep_state=True)
        return None

    async def drop(self, live: LiveSession) -> None:
        """Stop a hibernated session's standby sandbox (the session is being deleted)."""
        standby, live.standby = live.standby, None
        if standby is None:
            return
        standby.cancel()
        with contextlib.suppress(BaseException):
            await (await standby).close(keep_state=True)


def top_modules(imports: object) -> list[str]:
    """The top-level packages a capture's ``imports`` name (``np -> numpy``)."""
    found: set[str] = set()
    if isinstance(imports, dict):
        for spec in imports.values():
            module = spec.get("module") if isinstance(spec, dict) else None
            if isinstance(module, str) and module.split(".")[0].isidentifier():
                found.add(module.split(".")[0])
    return sorted(found)


def info_modules(snap: StoredSnapshot | None) -> list[str]:
    modules = snap.metadata.get("modules") if snap is not None else None
    return [m for m in modules if isinstance(m, str) and m.isidentifier()] if modules else []


def kept_capture(kernel: KernelSession, name: object) -> str | None:
    """``name`` if that capture is still in the session's state directory on the host
    (gone after a gateway restart reaped it, or where Docker keeps the directory)."""
    if not isinstance(name, str) or not name.replace("-", "").isalnum():
        return None
    manifest = state_dir(kernel.sandbox.session_dir.root.parent, kernel.id) / name / "manifest.json"
    return name if manifest.is_file() and not manifest.is_symlink() else None
