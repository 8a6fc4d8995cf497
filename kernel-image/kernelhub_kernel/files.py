"""Move one file in or out of ``/workspace``, run by the host through ``docker exec``.

    python -I -S /opt/kernelhub/kernelhub_kernel/files.py put RELPATH MAX_BYTES   < data
    python -I -S /opt/kernelhub/kernelhub_kernel/files.py get RELPATH MAX_BYTES   > data

The host runs it by absolute path, isolated (``-I``: no ``PYTHON*`` variables, no script or
working directory on ``sys.path``) from ``/``, and it imports only the standard library: a
``kernelhub_kernel`` planted in ``/workspace`` is never imported instead. (Older hosts ran
``-m kernelhub_kernel.files`` from ``/workspace``; that still works.)

It runs as the sandbox user with the container's own restrictions, and resolves the path
one component at a time with ``O_NOFOLLOW`` beneath ``/workspace``: ``..``, absolute paths
and any symlink along the way (planted by code in the sandbox) are refused, so the host
only ever receives bytes of a regular file inside the workspace.

Snapshots travel the same way, as one opaque tar stream the host stores but never opens:

    python -I -S .../files.py pack NAME MAX_BYTES     > tar    (/tmp/.kernelhub/NAME)
    python -I -S .../files.py unpack NAME MAX_BYTES   < tar

Exit codes: 0 done, 2 bad path, 3 not found, 4 too large, 5 not a regular file / a symlink.
"""

from __future__ import annotations

import errno
import os
import stat
import sys

ROOT = os.environ.get("KERNELHUB_WORKSPACE", "/workspace")
CHUNK = 1 << 16


class Refused(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def parts_of(relpath: str) -> list[str]:
    parts = [p for p in relpath.split("/") if p not in ("", ".")]
    if relpath.startswith("/") or not parts or any(p == ".." for p in parts):
        raise Refused(2, f"path {relpath!r} must be relative to /workspace, without '..'")
    return parts


def open_parent(parts: list[str], *, create: bool) -> int:
    fd = os.open(ROOT, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    for name in parts[:-1]:
        try:
            nxt = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                os.close(fd)
                raise Refused(3, f"no directory {name!r} in the workspace") from None
            os.mkdir(name, 0o700, dir_fd=fd)
            nxt = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            raise Refused(5, f"{name!r} is not a directory (or is a symlink)") from exc
        os.close(fd)
        fd = nxt
    return fd


def put(relpath: str, max_bytes: int) -> int:
    parts = parts_of(relpath)
    parent = open_parent(parts, create=True)
    try:
        fd = os.open(
            parts[-1],
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK,
            0o600,
            dir_fd=parent,
        )
    except OSError as exc:
        raise Refused(5, f"{relpath!r} is a symlink or not a regular file") from exc
    finally:
        os.close(parent)
    total = 0
    with os.fdopen(fd, "wb") as out:
        if not stat.S_ISREG(os.fstat(out.fileno()).st_mode):
            raise Refused(5, f"{relpath!r} is not a regular file")
        while chunk := sys.stdin.buffer.read(CHUNK):
            total += len(chunk)
            if total > max_bytes:
                out.truncate(0)
                raise Refused(4, f"upload is larger than {max_bytes} bytes")
            out.write(chunk)
    return total


def get(relpath: str, max_bytes: int) -> int:
    parts = parts_of(relpath)
    parent = open_parent(parts, create=False)
    try:
        # O_NONBLOCK: opening a FIFO planted by the sandbox returns at once instead of
        # waiting for a writer; the fstat below then refuses it (and devices, sockets).
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
    except FileNotFoundError:
        raise Refused(3, f"no file {relpath!r} in the workspace") from None
    except OSError as exc:
        code = 5 if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO) else 3
        raise Refused(code, f"{relpath!r} is a symlink or not a regular file") from exc
    finally:
        os.close(parent)
    with os.fdopen(fd, "rb") as src:
        st = os.fstat(src.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Refused(5, f"{relpath!r} is not a regular file")
        if st.st_size > max_bytes:
            raise Refused(4, f"{relpath!r} is {st.st_size} bytes, over the {max_bytes}-byte limit")
        total = 0
        while chunk := src.read(CHUNK):
            total += len(chunk)
            if total > max_bytes:  # it grew after the fstat
                raise Refused(4, f"{relpath!r} grew over the {max_bytes}-byte limit")
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
    return total


SNAPSHOTS = os.environ.get("KERNELHUB_SNAPSHOTS", "/tmp/.kernelhub")


def _snapshot_dir(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise Refused(2, f"snapshot name {name!r} must be a single path component")
    return os.path.join(SNAPSHOTS, name)


def pack(name: str, max_bytes: int) -> int:
    """Stream the snapshot directory as a tar (regular files and directories only)."""
    import tarfile

    root = _snapshot_dir(name)
    if not os.path.isdir(root):
        raise Refused(3, f"no snapshot {name!r}")
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            if not stat.S_ISREG(st.st_mode):
                raise Refused(5, f"snapshot {name!r} holds something other than files")
            total += st.st_size
    if total > max_bytes:
        raise Refused(4, f"snapshot {name!r} is {total} bytes, over the {max_bytes}-byte limit")
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        tar.add(root, arcname=".", recursive=True)
    return total


def unpack(name: str, max_bytes: int) -> int:
    """Extract a tar from stdin into a new snapshot directory; files and directories only,
    nothing outside it (the tar came from the host, but the host never looked inside)."""
    import tarfile

    root = _snapshot_dir(name)
    os.makedirs(root, mode=0o700)
    total = 0
    # Written by hand rather than with extraction filters: the image's Python (3.11.2)
    # predates them.
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        for member in tar:
            parts = [p for p in member.name.split("/") if p not in ("", ".")]
            if member.name.startswith("/") or any(p == ".." for p in parts):
                raise Refused(2, f"snapshot member {member.name!r} points outside")
            if not parts:
                continue
            target = os.path.join(root, *parts)
            if member.isdir():
                os.makedirs(target, mode=0o700, exist_ok=True)
                continue
            if not member.isfile():
                raise Refused(5, f"snapshot member {member.name!r} is not a file or directory")
            total += member.size
            if total > max_bytes:
                raise Refused(4, f"snapshot is larger than {max_bytes} bytes")
            os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
    return total


def main(argv: list[str]) -> int:
    try:
        verb, relpath, limit = argv
        max_bytes = int(limit)
    except ValueError:
        print("usage: files put|get RELPATH MAX_BYTES", file=sys.stderr)
        return 2
    try:
        if verb == "put":
            put(relpath, max_bytes)
        elif verb == "get":
            get(relpath, max_bytes)
        elif verb == "pack":
            pack(relpath, max_bytes)
        elif verb == "unpack":
            unpack(relpath, max_bytes)
        else:
            raise Refused(2, f"unknown verb {verb!r}")
    except Refused as exc:
        print(exc, file=sys.stderr)
        return exc.code
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
