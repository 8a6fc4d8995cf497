"""The workspace tar (``snapshot/workspace.py``) on real directories: what is scanned,
written and hashed, and what extraction refuses."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from tests.unit.snapshot import kernel_side

snapshot = kernel_side.load()
workspace = snapshot.workspace
common = snapshot.common


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "a.txt").write_text("alpha")
    (root / "sub" / "b.bin").write_bytes(b"\x00\x01" * 1000)
    (root / "sub" / "deep" / "c.txt").write_text("gamma")
    os.chmod(root / "a.txt", 0o640)
    (root / "rel-link").symlink_to("sub/b.bin")
    (root / "abs-link").symlink_to(root / "sub" / "deep" / "c.txt")
    os.mkfifo(root / "fifo")
    (root / ".kernelhub").mkdir()
    (root / ".kernelhub" / "state").write_text("excluded")
    return root


def test_scan_lists_dirs_files_links_sorted_and_names_what_it_skips(tree: Path) -> None:
    entries, skipped = workspace._scan_workspace(str(tree), str(tree / ".kernelhub"))
    by_path = {e[0]: e for e in entries}
    assert [e[0] for e in entries] == sorted(by_path, key=lambda p: p.split("/"))
    assert by_path["a.txt"][1:3] == ("file", 5)
    assert by_path["a.txt"][4] == 0o640
    assert by_path["sub"][1] == "dir"
    assert by_path["rel-link"][1] == "link" and by_path["rel-link"][5] == "sub/b.bin"
    assert not any(p.startswith(".kernelhub") for p in by_path)
    assert skipped == [{"path": "fifo", "reason": "not a regular file, directory or symlink"}]


def test_scan_of_a_missing_root_is_named_not_raised(tmp_path: Path) -> None:
    entries, skipped = workspace._scan_workspace(str(tmp_path / "none"), None)
    assert entries == [] and skipped[0]["path"] == "." and "cannot list" in skipped[0]["reason"]


def test_tar_round_trip_with_a_hash_and_absolute_links_made_relative(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries, _ = workspace._scan_workspace(str(tree), str(tree / ".kernelhub"))
    snap = tmp_path / "snap"
    snap.mkdir()
    out = snap / common.WORKSPACE_TAR
    digest, files, size, skipped = workspace._write_workspace_tar(str(out), str(tree), entries)
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    assert files == 3 and size == out.stat().st_size and skipped == []
    with tarfile.open(out) as tar:
        link = tar.getmember("abs-link")
    assert link.linkname == "sub/deep/c.txt"

    dest = tmp_path / "restored"
    monkeypatch.setenv(common.WORKSPACE_ENV, str(dest))
    result = workspace._extract_workspace(str(snap), {})
    assert result["root"] == str(dest) and result["files"] == 3 and result["refused"] == []
    assert (dest / "a.txt").read_text() == "alpha"
    assert (dest / "sub" / "b.bin").read_bytes() == b"\x00\x01" * 1000
    assert (dest / "abs-link").read_text() == "gamma"  # now relative: points into dest
    assert os.readlink(dest / "rel-link") == "sub/b.bin"


def test_writing_to_an_open_file_is_not_hashed(tree: Path, tmp_path: Path) -> None:
    entries, _ = workspace._scan_workspace(str(tree), None)
    with open(tmp_path / "w.tar", "wb") as f:
        digest, files, size, _ = workspace._write_workspace_tar(f, str(tree), entries)
    assert digest == "" and files == 4 and size == (tmp_path / "w.tar").stat().st_size


def test_a_file_that_vanishes_or_shrinks_is_named(tree: Path, tmp_path: Path) -> None:
    entries, _ = workspace._scan_workspace(str(tree), str(tree / ".kernelhub"))
    (tree / "a.txt").unlink()
    _, files, _, skipped = workspace._write_workspace_tar(
        str(tmp_path / "t.tar"), str(tree), entries
    )
    assert files == 2
    assert [s["path"] for s in skipped] == ["a.txt"] and "cannot read" in skipped[0]["reason"]

    reader = workspace._PaddedReader(io.BytesIO(b"abc"), 5)
    assert reader.read() == b"abc\0\0" and reader.short
    assert reader.read() == b""
    whole = workspace._PaddedReader(io.BytesIO(b"abcdef"), 4)
    assert whole.read(2) == b"ab" and whole.read(10) == b"cd" and not whole.short


def _evil_tar(members: list[tuple[str, bytes, bytes | None]]) -> io.BytesIO:
    """(name, type, linkname or None) -> a tar in memory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, linkname in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if linkname is not None:
                info.linkname = linkname.decode()
            data = b"x" if kind == tarfile.REGTYPE else b""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def test_extraction_refuses_escapes_and_keeps_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "ws"
    monkeypatch.setenv(common.WORKSPACE_ENV, str(dest))
    tar = _evil_tar(
        [
            ("/etc/evil", tarfile.REGTYPE, None),
            ("a/../../escape", tarfile.REGTYPE, None),
            ("a/../inside.txt", tarfile.REGTYPE, None),  # data_filter alone allows it
            ("out-link", tarfile.SYMTYPE, b"/etc/passwd"),
            ("up-link", tarfile.SYMTYPE, b"../../outside"),
            ("dev", tarfile.CHRTYPE, None),
            ("good.txt", tarfile.REGTYPE, None),
        ]
    )
    result = workspace._extract_workspace(tar, {})
    refused = {r["path"] for r in result["refused"]}
    assert refused == {
        "/etc/evil",
        "a/../../escape",
        "a/../inside.txt",
        "out-link",
        "up-link",
        "dev",
    }
    assert result["files"] == 1
    assert sorted(os.listdir(dest)) == ["good.txt"]
    assert not (tmp_path / "escape").exists()


def test_workspace_root_is_read_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(common.WORKSPACE_ENV, raising=False)
    assert workspace.workspace_root() == common.DEFAULT_WORKSPACE
    monkeypatch.setenv(common.WORKSPACE_ENV, "/elsewhere")
    assert workspace.workspace_root() == "/elsewhere"
