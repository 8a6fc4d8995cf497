"""Host directories a sandbox writes: capped tmpfs mounts, and their safe removal.

As root, each directory a sandbox can write on the host (its socket directory, its state
directory) is a tmpfs of its own with a size and inode cap (``mount_tmpfs``): pages written
there are charged to the writing sandbox's memory cgroup, and it can never fill the host's
disk or ``/run``.

Everything under a socket or state directory may have been made by hostile code: a tree
3,000 directories deep (``shutil.rmtree`` recurses and raises ``RecursionError``; a path
that long is also past ``PATH_MAX``), names with newlines or invalid UTF-8, symlinks to
the host's files, directories without permissions. ``remove_tree`` walks iteratively with
one directory descriptor open at a time, never follows a link, never crosses into another
filesystem, and checks each step up against the identity it recorded on the way down, so
a directory moved under it makes it stop rather than delete elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# <sys/mount.h>
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MNT_DETACH = 2


@functools.cache
def _libc() -> ctypes.CDLL:
    # The syscalls directly: spawning mount(8)/umount(8) cost a fork and exec of a
    # setuid binary per call, twice per cold create.
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: Path, fstype: str, flags: int, options: str) -> int:
    """mount(2); 0, or the errno."""
    done = _libc().mount(
        source.encode(), os.fsencode(target), fstype.encode(), ctypes.c_ulong(flags),
        options.encode(),
    )  # fmt: skip
    return 0 if done == 0 else ctypes.get_errno()


def _umount_lazy(target: Path) -> int:
    """umount2(2) with MNT_DETACH; 0, or the errno."""
    done = _libc().umount2(os.fsencode(target), _MNT_DETACH)
    return 0 if done == 0 else ctypes.get_errno()


def mount_tmpfs(
    path: Path, *, size_bytes: int, uid: int, gid: int, inodes: int | None = None
) -> bool:
    """Mount a tmpfs capped at ``size_bytes`` (and ``inodes``) on the existing, empty
    directory ``path``, owned by ``uid:gid`` with mode 0700; no exec, suid or devices.
    True if mounted (or already a mount); False where this process may not mount
    (not root, or a container without CAP_SYS_ADMIN): the caller decides the fallback."""
    if os.path.ismount(path):
        return True
    if os.geteuid() != 0:
        return False
    options = f"size={size_bytes},mode=0700,uid={uid},gid={gid}"
    if inodes is not None:
        options += f",nr_inodes={inodes}"
    failed = _mount("kernelhub", path, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options)
    if failed:
        log.warning("cannot mount a capped tmpfs on %s: %s", path, os.strerror(failed))
        return False
    return True


def can_mount_tmpfs(parent: Path) -> bool:
    """Whether this process may mount a tmpfs (tried on a scratch directory in
    ``parent``, then undone)."""
    if os.geteuid() != 0:
        return False
    parent.mkdir(parents=True, exist_ok=True)
    probe = parent / f".mount-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        mounted = mount_tmpfs(probe, size_bytes=4096, uid=0, gid=0)
        unmount(probe)
        return mounted
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def uncapped_run_dir(
    run_dir: Path, *, can_mount: bool, filesystem_bytes: int, max_bytes: int | None
) -> str | None:
    """Why ``run_dir`` must not serve sandboxes, or None. Where each socket directory
    cannot be a capped tmpfs of its own, whatever a sandbox writes there lands on the
    filesystem ``run_dir`` is on: it must be small."""
    if can_mount or max_bytes is None or filesystem_bytes <= max_bytes:
        return None
    return (
        f"KERNELHUB_RUN_DIR {run_dir} is on a filesystem of {filesystem_bytes} bytes and "
        "this gateway may not mount a capped tmpfs per session (not root, or a container "
        "without CAP_SYS_ADMIN): sandboxes could fill it through their socket directories. "
        f"Mount a small tmpfs there first (on the host: `mount -t tmpfs -o "
        f"size=16m,mode=0711 kernelhub {run_dir}`), or raise "
        f"KERNELHUB_DOCKER__RUN_DIR_MAX_BYTES (now {max_bytes}; null starts anyway)"
    )


def unmount(path: Path) -> None:
    """Detach the filesystem mounted at ``path``, if any (lazily: a process that still
    holds a file there keeps its pages until it lets go, but no path reaches them)."""
    if os.path.ismount(path):
        failed = _umount_lazy(path)
        if failed and failed != errno.EINVAL:  # EINVAL: not a mount point (any more)
            log.warning("cannot unmount %s: %s", path, os.strerror(failed))


def remove_tree(path: Path, *, last: str | None = None) -> None:
    """Remove ``path`` (a directory, file or symlink) and everything beneath it.

    ``last``: a name directly under ``path`` removed only once everything else is gone
    (``labels.json``, by which the reaper finds a directory whose removal failed).
    A missing ``path`` is fine. Raises ``OSError`` naming the first entry it could not
    remove, after removing everything else it could."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    failed = _empty(path, st, last)
    if failed is not None:
        raise failed
    if last is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path / last)
    os.rmdir(path)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _open_dir(name: str | Path, st: os.stat_result, dir_fd: int | None) -> int:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        # The sandbox took its own directory's permissions away (it owns it; as the
        # same uid we need them back to list it). The identity check below catches a
        # swap for a symlink between the lstat and this chmod.
        os.chmod(name, 0o700, dir_fd=dir_fd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    if _identity(os.fstat(fd)) != _identity(st):
        os.close(fd)
        raise OSError(errno.ESTALE, f"{name!r} changed while it was being removed")
    return fd


def _empty(path: Path, root: os.stat_result, keep: str | None) -> OSError | None:
    """Remove everything below ``path`` except ``keep``; the first failure, or None."""
    fd = _open_dir(path, root, None)
    # Identities and names from the root down to the directory ``fd`` is open on.
    trail: list[tuple[tuple[int, int], str]] = [(_identity(root), "")]
    skipped: set[tuple[tuple[int, int], str]] = set()
    failed: OSError | None = None
    try:
        while True:
            here = trail[-1][0]
            child = _next_subdir(fd, here, root.st_dev, keep if len(trail) == 1 else None, skipped)
            if isinstance(child, OSError):
                failed = failed or child
                continue
            if child is not None:
                name, st = child
                try:
                    sub = _open_dir(name, st, fd)
                except OSError as exc:
                    skipped.add((here, name))
                    failed = failed or exc
                    continue
                os.close(fd)
                fd = sub
                trail.append((_identity(st), name))
                continue
            # This directory is empty (but for what could not go): up one level.
            if len(trail) == 1:
                return failed
            _, name = trail.pop()
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            if _identity(os.fstat(fd)) != trail[-1][0]:
                raise OSError(errno.ESTALE, f"a directory under {path} moved during its removal")
            try:
                os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                skipped.add((trail[-1][0], name))
                failed = failed or exc
    finally:
        os.close(fd)


def _next_subdir(
    fd: int,
    here: tuple[int, int],
    device: int,
    keep: str | None,
    skipped: set[tuple[tuple[int, int], str]],
) -> tuple[str, os.stat_result] | OSError | None:
    """Unlink every non-directory in the directory ``fd``; return the first
    subdirectory to descend into (with its lstat), an error to record, or None."""
    with os.scandir(fd) as entries:
        for entry in entries:
            name = entry.name
            if name == keep or (here, name) in skipped:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev != device:
                    # Another filesystem mounted here: never walk into it.
                    skipped.add((here, name))
                    return OSError(errno.EBUSY, f"{name!r} is a mount point; unmount it first")
                return name, st
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                skipped.add((here, name))
                return exc
    return None
