"""A session's state directory: where its kernel writes snapshots and checkpoints (the
kernel's ``/tmp/.kernelhub``).

It lives on the host beside the sandbox, not inside it, so checkpoints outlive a kernel
that dies (crash recovery restores from them in a fresh sandbox), and the files program can
pack them from outside. As root it is a tmpfs of its own, sized like the sandbox's /tmp:
pages written into it are charged to the writing sandbox's memory cgroup, and untrusted
code can never fill the host's disk through it. Without root it is a plain directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

SANDBOX_PATH = "/tmp/.kernelhub"


def state_dir(run_dir: Path, session_id: str) -> Path:
    return run_dir / f"{session_id}.state"


def ensure_state_dir(path: Path, *, uid: int, gid: int, size_bytes: int) -> None:
    """Create (or keep) the directory; idempotent, so a recovering session finds its
    checkpoints where its previous sandbox left them."""
    if path.is_dir():
        return
    path.mkdir(mode=0o700)
    if os.geteuid() == 0:
        options = f"size={size_bytes},mode=0700,uid={uid},gid={gid},nosuid,nodev"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "kernelhub-state", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode == 0:
            return
        log.warning(
            "state directory %s is not size-limited: mount failed: %s", path, done.stderr.strip()
        )
    if uid != os.geteuid():
        os.chown(path, uid, gid)


def drop_state_dir(path: Path) -> None:
    if os.path.ismount(path):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
    shutil.rmtree(path, ignore_errors=True)
