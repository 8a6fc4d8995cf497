"""``kernelhub_unchanged_since`` in a cell's execute_reply metadata: the name of this
kernel's last capture (checkpoint directory) when the cell changed nothing a capture
keeps, so the gateway skips the checkpoint after it (``1+1`` then costs no capture).

The decision is the capture's own (the tracker's names, the namespace's ids, the
workspace's fingerprint), taken right after the cell instead of at the next capture;
anything uncertain answers "changed". ``KERNELHUB_KERNEL_REPORT_UNCHANGED=0`` turns the
report off: the kernel then behaves like an image from before it (a checkpoint after
every cell), which is how the gateway's fallback is tested.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

from .workspace import _scan_workspace, workspace_root

if TYPE_CHECKING:
    from .session import _Session

METADATA_KEY = "kernelhub_unchanged_since"
REPORT_ENV = "KERNELHUB_KERNEL_REPORT_UNCHANGED"


def unchanged_since(session: _Session) -> str | None:
    """The last capture's name if nothing it keeps changed since, else None."""
    path = session.capture_path
    tracker = session.tracker
    if path is None or session.snapshot_id is None or tracker.all_dirty:
        return None
    ns = session.shell.user_ns
    ids = session.ids
    # Rebinding a kept name (``counter += 1``, ``total = ...``: most cells) is a change
    # the ids show at once; the cell analysis is then left to the checkpoint that follows,
    # off this reply's path (it cost ~0.4 ms of a 5 ms cell, every cell).
    for name, ident in ids.items():
        value = ns.get(name, _MISSING)
        if value is _MISSING or id(value) != ident:
            return None
    tracker.settle()  # the analysis the next capture would do, done now
    if tracker.all_dirty:
        return None
    for name in tracker.names:
        # A name bound or maybe mutated: a change if a capture keeps it, or would now
        # (a comprehension's variable, gone again, is not).
        if name in ids or name in ns:
            return None
    if not _workspace_same(session, path):
        return None
    return os.path.basename(path)


_MISSING = object()


def _workspace_same(session: _Session, path: str) -> bool:
    root = workspace_root()
    previous = session.workspace
    if not os.path.isdir(root):
        return previous is None
    if previous is None:
        return False
    entries, _ = _scan_workspace(root, exclude=path)
    fingerprint = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
    return bool(previous.get("fingerprint") == fingerprint)


def install(shell: Any) -> None:
    """Wrap the kernel's ``finish_metadata`` (ipykernel builds every execute_reply's
    metadata with it, after the cell's post_run_cell hooks ran). Idempotent."""
    if os.environ.get(REPORT_ENV, "1") == "0":
        return
    kernel = getattr(shell, "kernel", None)
    original = getattr(kernel, "finish_metadata", None)
    if original is None or getattr(original, "_kernelhub", False):
        return

    def finish_metadata(parent: Any, metadata: Any, reply_content: Any) -> Any:
        metadata = original(parent, metadata, reply_content)
        with contextlib.suppress(Exception):  # never break a reply over a hint
            header = parent.get("header") or {}
            content = parent.get("content") or {}
            if header.get("msg_type") == "execute_request" and not content.get("silent"):
                from .session import _SESSION

                if _SESSION is not None and _SESSION.shell is shell:
                    name = unchanged_since(_SESSION)
                    if name is not None:
                        metadata[METADATA_KEY] = name
        return metadata

    finish_metadata._kernelhub = True  # type: ignore[attr-defined]
    kernel.finish_metadata = finish_metadata
