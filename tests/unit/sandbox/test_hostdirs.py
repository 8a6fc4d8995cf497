"""remove_tree against what a hostile sandbox can leave in a directory it writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernelhub.sandbox.hostdirs import mount_tmpfs, remove_tree, uncapped_run_dir, unmount


def deep_tree(root: Path, depth: int) -> None:
    """``root/d/d/.../d/leaf`` ``depth`` levels down, built with descriptors (the path is
    far past PATH_MAX)."""
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    os.close(fd)


def test_a_3000_deep_tree_is_removed(tmp_path: Path) -> None:
    deep_tree(tmp_path / "ipc", 3000)
    remove_tree(tmp_path / "ipc")
    assert not (tmp_path / "ipc").exists()


def test_symlinks_are_removed_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    tree = tmp_path / "ipc"
    (tree / "sub").mkdir(parents=True)
    (tree / "to-dir").symlink_to(outside)
    (tree / "sub" / "to-file").symlink_to(outside / "precious")
    (tree / "dangling").symlink_to(tmp_path / "nowhere")
    remove_tree(tree)
    assert not tree.exists()
    assert (outside / "precious").read_text() == "keep"


def test_odd_names_and_locked_directories_are_removed(tmp_path: Path) -> None:
    tree = tmp_path / "ipc"
    tree.mkdir()
    for name in (b"new\nline", b"\xff\xfe-not-utf8", b" ", b"-rf", b"..."):
        os.makedirs(os.path.join(os.fsencode(tree), name, b"x"))
        open(os.path.join(os.fsencode(tree), name, b"x", b"f"), "wb").close()
    locked = tree / "locked"
    (locked / "inner").mkdir(parents=True)
    os.mkfifo(locked / "fifo")
    locked.chmod(0)
    remove_tree(tree)
    assert not tree.exists()


def test_the_last_name_goes_last_and_stays_when_something_cannot_go(tmp_path: Path) -> None:
    tree = tmp_path / "session"
    (tree / "ipc").mkdir(parents=True)
    (tree / "labels.json").write_text("{}")
    (tree / "ipc" / "f").write_text("x")
    remove_tree(tree, last="labels.json")
    assert not tree.exists()

    (tree / "ipc" / "mnt").mkdir(parents=True)
    (tree / "labels.json").write_text("{}")
    (tree / "ipc" / "other").write_text("x")
    if os.geteuid() != 0:
        # Without root, a directory the remover may not write stands in for a mount.
        (tree / "ipc").chmod(0o500)
    elif not mount_tmpfs(tree / "ipc" / "mnt", size_bytes=2**20, uid=0, gid=0):
        pytest.skip("root, but mounting is refused here")
    else:
        (tree / "ipc" / "mnt" / "inside").write_text("on the other filesystem")
    try:
        with pytest.raises(OSError):
            remove_tree(tree, last="labels.json")
        assert (tree / "labels.json").is_file(), "labels.json went before the rest"
        if os.geteuid() == 0:  # never walked into the other filesystem
            assert (tree / "ipc" / "mnt" / "inside").is_file()
    finally:
        (tree / "ipc").chmod(0o700)
        unmount(tree / "ipc" / "mnt")
    remove_tree(tree, last="labels.json")
    assert not tree.exists()


def test_a_file_or_a_missing_path(tmp_path: Path) -> None:
    remove_tree(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    remove_tree(tmp_path / "file")
    assert not (tmp_path / "file").exists()


def test_the_reaper_removes_only_its_own_gateways_directories(tmp_path: Path) -> None:
    from kernelhub.kernel.connection import SessionDir
    from kernelhub.sandbox.base import SandboxSpec, reap_directories
    from kernelhub.sandbox.state import ensure_state_dir

    def make(sid: str, instance: str, gateway: str) -> None:
        labels = SandboxSpec(session_id=sid).labels(instance, gateway)
        SessionDir.create(
            tmp_path / sid, sandbox_uid=os.geteuid(), sandbox_gid=os.getegid(), labels=labels
        )
        ensure_state_dir(
            tmp_path / f"{sid}.state",
            uid=os.geteuid(),
            gid=os.getegid(),
            size_bytes=2**20,
            labels=labels,
        )

    make("mine00", "i", "g1")
    make("live00", "i", "g1")
    make("other0", "i", "g2")  # same instance, another data directory
    make("elsewh", "j", "g1")  # another instance (never in this run_dir in practice)
    (tmp_path / "nolabl").mkdir()
    reap_directories(tmp_path, "i", "g1", {"live00"})
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "mine00" not in left and "mine00.state" not in left and "mine00.state.json" not in left
    for kept in ("live00", "other0", "elsewh", "nolabl"):
        assert kept in left
    for kept in ("live00", "other0", "elsewh"):
        assert f"{kept}.state" in left
    for sid in ("live00", "other0", "elsewh"):  # unmount the state tmpfs mounted as root
        from kernelhub.sandbox.state import drop_state_dir

        drop_state_dir(tmp_path / f"{sid}.state")


def test_a_run_dir_sandboxes_could_fill_is_refused_only_where_mounts_are() -> None:
    run = Path("/run/kernelhub/compose")
    big, small, most = 2 * 2**30, 16 * 2**20, 256 * 2**20
    assert uncapped_run_dir(run, can_mount=True, filesystem_bytes=big, max_bytes=most) is None
    assert uncapped_run_dir(run, can_mount=False, filesystem_bytes=small, max_bytes=most) is None
    assert uncapped_run_dir(run, can_mount=False, filesystem_bytes=big, max_bytes=None) is None
    problem = uncapped_run_dir(run, can_mount=False, filesystem_bytes=big, max_bytes=most)
    assert problem is not None
    assert str(run) in problem and str(big) in problem and str(most) in problem
    assert "mount -t tmpfs" in problem and "KERNELHUB_DOCKER__RUN_DIR_MAX_BYTES" in problem


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_a_capped_tmpfs_is_mounted_with_its_caps_and_unmounted_by_syscall(tmp_path: Path) -> None:
    target = tmp_path / "ipc"
    target.mkdir()
    assert mount_tmpfs(target, size_bytes=2**20, uid=1234, gid=4321, inodes=64)
    try:
        (entry,) = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()
                    if line.split()[1] == str(target)]  # fmt: skip
        options = set(entry[3].split(","))
        assert entry[2] == "tmpfs"
        assert {"nosuid", "nodev", "noexec", "size=1024k", "nr_inodes=64", "mode=700"} <= options
        st = os.stat(target)
        assert (st.st_uid, st.st_gid) == (1234, 4321)
    finally:
        unmount(target)
    assert not os.path.ismount(target)
    unmount(target)  # not a mount any more: nothing to do, no error
