"""Where a kernel's sockets live and how we reach them safely.

Each sandbox gets a host directory ``<run_dir>/<instance>/<session>/``:

    labels.json     who made this (host-only; cleanup finds directories by it)
    kernel.json     connection info *with the HMAC key*, mounted read-only into the sandbox
    ipc/            writable by the sandbox uid; the kernel binds its ZeroMQ ipc sockets here

The kernel can write into ``ipc/``, so everything in it is hostile: we never follow a
symlink there, we open each socket with ``O_PATH|O_NOFOLLOW``, check it really is a
socket owned by the sandbox uid, and connect through ``/proc/self/fd/N`` so the checked
inode is the one we talk to. Nothing in the directory is rewritten after the sandbox starts.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import SecretStr

from kernelhub.errors import SandboxError, UnsafeSocketError
from kernelhub.sandbox.hostdirs import remove_tree, unmount

log = logging.getLogger(__name__)

CHANNELS = ("shell", "iopub", "stdin", "control", "hb")
# Fixed "ports": with the ipc transport they are only suffixes of the socket file names.
PORTS: Mapping[str, int] = {name: i + 1 for i, name in enumerate(CHANNELS)}
SOCKET_PREFIX = "k"
SIGNATURE_SCHEME = "hmac-sha256"


def new_key() -> SecretStr:
    """A fresh HMAC key for one kernel. Never put it in an environment or a log."""
    return SecretStr(secrets.token_hex(32))


def connection_info(ipc_prefix: str, key: SecretStr) -> dict[str, object]:
    """Jupyter connection info for sockets named ``<ipc_prefix>-<port>``."""
    info: dict[str, object] = {
        "transport": "ipc",
        "ip": ipc_prefix,
        "key": key.get_secret_value(),
        "signature_scheme": SIGNATURE_SCHEME,
        "kernel_name": "kernelhub",
    }
    info.update({f"{name}_port": port for name, port in PORTS.items()})
    return info


@dataclass
class SessionDir:
    """The host directory of one sandbox (see the module docstring)."""

    root: Path
    sandbox_uid: int
    key: SecretStr = field(repr=False)

    @property
    def ipc_dir(self) -> Path:
        return self.root / "ipc"

    @property
    def connection_file(self) -> Path:
        return self.root / "kernel.json"

    @property
    def host_ipc_prefix(self) -> str:
        return str(self.ipc_dir / SOCKET_PREFIX)

    def host_connection_info(self) -> dict[str, object]:
        return connection_info(self.host_ipc_prefix, self.key)

    @classmethod
    def create(
        cls,
        root: Path,
        *,
        sandbox_uid: int,
        sandbox_gid: int,
        labels: Mapping[str, str],
        kernel_ipc_prefix: str | None = None,
    ) -> SessionDir:
        """Create the directory and write ``kernel.json`` once, before the sandbox starts.

        ``kernel_ipc_prefix`` is the socket prefix as the kernel sees it (inside a
        container: ``/run/kernelhub/ipc/k``); by default the host path.
        """
        key = new_key()
        root.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
        root.mkdir(mode=0o711)
        me = os.geteuid()
        (root / "labels.json").write_text(json.dumps(dict(labels)))
        ipc = root / "ipc"
        ipc.mkdir(mode=0o700)
        conn = root / "kernel.json"
        info = connection_info(kernel_ipc_prefix or str(ipc / SOCKET_PREFIX), key)
        fd = os.open(conn, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
        with os.fdopen(fd, "w") as fh:
            json.dump(info, fh)
        if sandbox_uid != me:
            os.chown(ipc, sandbox_uid, sandbox_gid)
            os.chown(conn, sandbox_uid, sandbox_gid)
        return cls(root=root, sandbox_uid=sandbox_uid, key=key)

    @classmethod
    def load(cls, root: Path, *, sandbox_uid: int) -> SessionDir:
        """Re-open the directory of a sandbox that outlived its kernelhub process."""
        try:
            fd = os.open(root / "kernel.json", os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as fh:
                info = json.load(fh)
            key = SecretStr(str(info["key"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SandboxError(f"cannot re-open the sandbox directory {root}: {exc}") from exc
        return cls(root=root, sandbox_uid=sandbox_uid, key=key)

    @staticmethod
    def read_labels(root: Path) -> dict[str, str]:
        """What ``<root>/labels.json`` says made the directory (empty if unreadable)."""
        try:
            fd = os.open(root / "labels.json", os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as fh:
                found = json.load(fh)
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}

    def remove(self) -> None:
        """Unmount ``ipc/`` and remove everything; ``labels.json`` goes last, so a
        directory whose removal failed is still found (and retried) by the reaper."""
        self.remove_root(self.root)

    @staticmethod
    def remove_root(root: Path) -> None:
        unmount(root / "ipc")
        try:
            remove_tree(root, last="labels.json")
        except OSError as exc:
            log.warning("sandbox directory %s is left for the reaper: %s", root, exc)

    def sockets_present(self) -> bool:
        try:
            names = set(os.listdir(self.ipc_dir))
        except OSError:
            return False
        return all(f"{SOCKET_PREFIX}-{port}" in names for port in PORTS.values())

    def open_sockets(self) -> dict[str, int]:
        """Open every kernel socket as an ``O_PATH`` descriptor after checking it.

        Returns channel → fd; connect to ``ipc:///proc/self/fd/<fd>``. The caller closes
        the descriptors when it disconnects.
        """
        fds: dict[str, int] = {}
        try:
            dir_fd = os.open(self.ipc_dir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            raise SandboxError(f"socket directory {self.ipc_dir} is unusable: {exc}") from exc
        try:
            for name, port in PORTS.items():
                fds[name] = _open_socket(dir_fd, f"{SOCKET_PREFIX}-{port}", self.sandbox_uid)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        finally:
            os.close(dir_fd)
        return fds

    def open_socket(self, name: str) -> int:
        """Open one more socket the kernel bound in ``ipc/`` (a snapshot stream) as a
        checked ``O_PATH`` descriptor, as ``open_sockets`` does; the caller closes it."""
        try:
            dir_fd = os.open(self.ipc_dir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            raise SandboxError(f"socket directory {self.ipc_dir} is unusable: {exc}") from exc
        try:
            return _open_socket(dir_fd, name, self.sandbox_uid)
        finally:
            os.close(dir_fd)


def _open_socket(dir_fd: int, name: str, uid: int) -> int:
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        raise UnsafeSocketError(f"kernel socket {name!r} cannot be opened: {exc}") from exc
    st = os.fstat(fd)
    if stat.S_ISLNK(st.st_mode):
        os.close(fd)
        raise UnsafeSocketError(f"kernel socket {name!r} is a symlink planted in the sandbox")
    if not stat.S_ISSOCK(st.st_mode):
        os.close(fd)
        raise UnsafeSocketError(f"kernel socket {name!r} is not a socket (mode {st.st_mode:o})")
    if st.st_uid != uid:
        os.close(fd)
        raise UnsafeSocketError(
            f"kernel socket {name!r} is owned by uid {st.st_uid}, not the sandbox uid {uid}"
        )
    return fd
