"""The workspace (``KERNELHUB_WORKSPACE``) as one tar in the snapshot: scan, write,
extract (regular files, directories and symlinks that stay inside)."""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from typing import Any

from .common import _COPY_CHUNK, DEFAULT_WORKSPACE, WORKSPACE_ENV, WORKSPACE_TAR


def workspace_root() -> str:
    """``KERNELHUB_WORKSPACE``, default ``/workspace``; read at each call, not at import."""
    return os.environ.get(WORKSPACE_ENV, DEFAULT_WORKSPACE)


def _scan_workspace(
    root: str, exclude: str | None
) -> tuple[list[tuple[str, str, int, int, int, str]], list[dict[str, str]]]:
    """Every directory, regular file and symlink under root (no link is followed):
    (relpath, kind, size, mtime_ns, mode, link target). Other kinds are skipped, named."""
    entries: list[tuple[str, str, int, int, int, str]] = []
    skipped: list[dict[str, str]] = []
    real_exclude = os.path.realpath(exclude) if exclude else None

    def walk(directory: str, prefix: str) -> None:
        try:
            listing = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            skipped.append({"path": prefix or ".", "reason": f"cannot list: {exc}"})
            return
        for item in listing:
            rel = f"{prefix}{item.name}"
            try:
                st = item.stat(follow_symlinks=False)
            except OSError as exc:
                skipped.append({"path": rel, "reason": f"cannot stat: {exc}"})
                continue
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(item.path)
                entries.append((rel, "link", 0, st.st_mtime_ns, st.st_mode & 0o777, target))
            elif stat.S_ISDIR(st.st_mode):
                if os.path.realpath(item.path) == real_exclude:
                    continue
                entries.append((rel, "dir", 0, st.st_mtime_ns, st.st_mode & 0o777, ""))
                walk(item.path, rel + "/")
            elif stat.S_ISREG(st.st_mode):
                entries.append((rel, "file", st.st_size, st.st_mtime_ns, st.st_mode & 0o777, ""))
            else:
                skipped.append({"path": rel, "reason": "not a regular file, directory or symlink"})

    walk(root, "")
    return entries, skipped


class _PaddedReader:
    """Reads exactly ``size`` bytes from a file that may shrink while being archived."""

    def __init__(self, f: Any, size: int) -> None:
        self._f = f
        self._left = size
        self.short = False

    def read(self, n: int = -1) -> bytes:
        n = self._left if n < 0 else min(n, self._left)
        data: bytes = self._f.read(n)
        if len(data) < n:
            self.short = True
            data += b"\0" * (n - len(data))
        self._left -= len(data)
        return data


def _write_workspace_tar(
    out: str | Any, root: str, entries: list[tuple[str, str, int, int, int, str]]
) -> tuple[str, int, int, list[dict[str, str]]]:
    """Write the tar to the path ``out`` (and hash it), or to the open file ``out`` (not
    hashed: the sha256 is ``""``)."""
    skipped: list[dict[str, str]] = []
    files = 0
    real_root = os.path.realpath(root)
    to_file = not isinstance(out, str)
    where: dict[str, Any] = {"fileobj": out} if to_file else {"name": out}
    with tarfile.open(mode="w", format=tarfile.PAX_FORMAT, **where) as tar:
        for rel, kind, _, mtime_ns, mode, target in entries:
            info = tarfile.TarInfo(rel)
            info.mtime = mtime_ns / 1e9
            info.mode = mode
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "link":
                info.type = tarfile.SYMTYPE
                if os.path.isabs(target) and (
                    target == real_root or target.startswith(real_root + os.sep)
                ):
                    # Absolute links into the workspace become relative: the restoring
                    # workspace may live elsewhere, and absolute links are refused there.
                    target = os.path.relpath(target, os.path.join(real_root, os.path.dirname(rel)))
                info.linkname = target
                tar.addfile(info)
            else:
                try:
                    with open(os.path.join(root, rel), "rb") as f:
                        info.size = os.fstat(f.fileno()).st_size
                        reader = _PaddedReader(f, info.size)
                        tar.addfile(info, reader)
                except OSError as exc:
                    skipped.append({"path": rel, "reason": f"cannot read: {exc}"})
                    continue
                if reader.short:
                    skipped.append({"path": rel, "reason": "shrank while archived; padded"})
                files += 1
    if to_file:
        out.flush()
        return "", files, os.fstat(out.fileno()).st_size, skipped
    digest = hashlib.sha256()
    with open(out, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest(), files, os.path.getsize(out), skipped


def _extract_workspace(source: str | Any, entry: dict[str, Any]) -> dict[str, Any]:
    """Extract the tar (in the snapshot directory ``source``, or the open file
    ``source``) into the workspace, refusing absolute paths, ``..``, links that point
    outside, and special files (tarfile's ``data`` filter, member by member)."""
    root = workspace_root()
    os.makedirs(root, exist_ok=True)
    refused: list[dict[str, str]] = []

    files = 0

    def only_safe(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        nonlocal files
        # tarfile's data filter would strip a leading "/" and allow "a/../b": refuse both.
        if member.name.startswith("/") or ".." in member.name.split("/"):
            refused.append({"path": member.name, "reason": "absolute path or '..'"})
            return None
        if not hasattr(tarfile, "data_filter"):
            # The image's Python (3.11.2) predates extraction filters: the same rules,
            # by hand. Regular files and directories only; links are refused.
            if not (member.isfile() or member.isdir()):
                refused.append({"path": member.name, "reason": "not a regular file or directory"})
                return None
            member.mode = (member.mode or 0o600) & 0o755
            member.uid = member.gid = 0
            member.uname = member.gname = ""
            files += member.isfile()
            return member
        try:
            safe = tarfile.data_filter(member, dest)
        except tarfile.FilterError as exc:
            refused.append({"path": member.name, "reason": f"{type(exc).__name__}: {exc}"})
            return None
        files += safe.isfile()
        return safe

    where: dict[str, Any] = (
        {"name": os.path.join(source, WORKSPACE_TAR)}
        if isinstance(source, str)
        else {"fileobj": source}
    )
    with tarfile.open(**where) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, filter=only_safe)
        else:
            for member in tar:
                kept = only_safe(member, root)
                if kept is not None:
                    tar.extract(kept, root, set_attrs=False)
    return {"root": root, "files": files, "refused": refused}
