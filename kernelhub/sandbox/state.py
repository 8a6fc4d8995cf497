"""A session's state directory: where its kernel writes snapshots and checkpoints (the
kernel's ``/tmp/.kernelhub``).

It lives on the host beside the sandbox, not inside it, so checkpoints outlive a kernel
that dies (crash recovery restores from them in a fresh sandbox), and the files program can
pack them from outside. As root it is a tmpfs of its own, sized like the sandbox's /tmp
(see :func:`~kernelhub.sandbox.hostdirs.mount_tmpfs`). Where that mount is refused (a
gateway in a container without CAP_SYS_ADMIN, as under compose) the docker backend gives
the sandbox a capped tmpfs of Docker's instead, which dies with its container; the plain
host directory is left only to the local development backend without root.

Beside it, ``<session>.state.json`` (host-only, not mounted) holds the labels the reaper
identifies it by; the sandbox can write the directory but not that file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from kernelhub.sandbox.hostdirs import mount_tmpfs, remove_tree, unmount

SANDBOX_PATH = "/tmp/.kernelhub"


SPOOL_FILE = "iopub.spool"  # kernelhub_kernel.spool: the running cell's messages


def spool_bytes(output_bytes: int) -> int:
    """What the kernel may spool of one cell (``KERNELHUB_SPOOL_BYTES``): twice the output
    cap and an envelope, so that the cap, applied again to the spooled messages, keeps the
    same head and tail the live cell would have kept."""
    return 2 * output_bytes + 2**20


def state_dir(run_dir: Path, session_id: str) -> Path:
    return run_dir / f"{session_id}.state"


def state_labels(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def ensure_state_dir(
    path: Path, *, uid: int, gid: int, size_bytes: int, labels: Mapping[str, str] | None = None
) -> bool:
    """Create (or keep) the directory; idempotent, so a recovering session finds its
    checkpoints where its previous sandbox left them. True if it is size-capped."""
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
        path.mkdir(mode=0o700)
    if labels is not None:
        state_labels(path).write_text(json.dumps(dict(labels)))
    capped = mount_tmpfs(path, size_bytes=size_bytes, uid=uid, gid=gid)
    if not capped and uid != os.geteuid():
        os.chown(path, uid, gid)
    return capped


def drop_state_dir(path: Path) -> None:
    unmount(path)
    remove_tree(path)
    state_labels(path).unlink(missing_ok=True)
