"""The snapshot stream's two ends, over socketpairs: the kernel's tar writer and reader
(``kernelhub_kernel/snapshot/stream.py``) and the host's receive and send
(``kernelhub.snapshot.transfer``): one hash, the cap, the verdict, and blobs packed
from a directory by tarfile read the same way."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import socket
import tarfile
import threading
from pathlib import Path

import pytest

from kernelhub.errors import InvalidRequestError, KernelError, SandboxError, TooLargeError
from kernelhub.snapshot import transfer
from tests.unit.snapshot.kernel_side import load

stream = load().stream
FOREVER = 1e12


def write_members(sock: socket.socket, members: list[tuple[str, list[bytes]]]) -> None:
    """The kernel's side; a host that hangs up (on purpose, in these tests) ends it."""
    with sock, contextlib.suppress(OSError):
        writer = stream.TarWriter(sock)
        for name, parts in members:
            writer.add_parts(name, [memoryview(p) for p in parts])
        writer.close()


def test_what_the_kernel_writes_the_host_stores_verbatim_with_one_hash(tmp_path: Path) -> None:
    kernel, host = socket.socketpair()
    payload = [b"pickle", bytes(range(256)) * 9000]
    members = [("groups/ab.pkl", payload), ("manifest.json", [b"{}"])]
    writer = threading.Thread(target=write_members, args=(kernel, members))
    writer.start()
    size, sha256 = transfer.receive(host, tmp_path / "blob", 1 << 30, threading.Event(), FOREVER)
    writer.join()
    data = (tmp_path / "blob").read_bytes()
    expected = transfer.new_digest(transfer.default_algorithm())
    expected.update(memoryview(data))
    assert size == len(data)
    assert sha256 == transfer.labelled(transfer.default_algorithm(), expected)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:  # a plain tar
        assert tar.getnames() == ["groups/ab.pkl", "manifest.json"]
        member = tar.extractfile("groups/ab.pkl")
        assert member is not None and member.read() == b"".join(payload)


def test_over_the_cap_the_blob_is_removed_and_the_error_names_the_knob(tmp_path: Path) -> None:
    kernel, host = socket.socketpair()
    members = [("groups/x.pkl", [bytes(32 << 20)])]
    writer = threading.Thread(target=write_members, args=(kernel, members))
    writer.start()
    with pytest.raises(TooLargeError, match="KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES"):
        transfer.receive(host, tmp_path / "blob", 8 << 20, threading.Event(), FOREVER)
    writer.join()
    assert not (tmp_path / "blob").exists()


def tar_of(members: dict[str, bytes]) -> bytes:
    """A blob as the files program packs a snapshot directory (``./`` names, a dir)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("./groups")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        for name, data in members.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def read_all(sock: socket.socket) -> tuple[dict[str, tuple[bytes, list[int] | None]], bool]:
    with sock:
        reader = stream.TarReader(sock)
        got = {}
        for name, size, parts in reader.members():
            got[name] = (bytes(reader.read(size)), parts)
        return got, reader.verdict()


@pytest.mark.parametrize("verdict", [True, False])
def test_the_kernel_reads_members_then_the_hosts_verdict(tmp_path: Path, verdict: bool) -> None:
    blob = tmp_path / "blob"
    long_name = "groups/" + "a" * 120 + ".pkl"  # a pax header carries the name
    blob.write_bytes(tar_of({long_name: b"x" * 5000, "manifest.json": b"{}"}))
    host, kernel = socket.socketpair()
    seen: list[str] = []

    def check(sha256: str) -> bool:
        seen.append(sha256)
        return verdict

    def send() -> None:
        with contextlib.suppress(InvalidRequestError):
            transfer.send(host, blob, check, threading.Event(), FOREVER)

    sender = threading.Thread(target=send)
    sender.start()
    got, said = read_all(kernel)
    sender.join()
    assert said is verdict
    assert got == {long_name: (b"x" * 5000, None), "manifest.json": (b"{}", None)}
    assert seen == [hashlib.sha256(blob.read_bytes()).hexdigest()]


def test_send_raises_when_the_verdict_is_no(tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(tar_of({"manifest.json": b"{}"}))
    host, kernel = socket.socketpair()
    reader = threading.Thread(target=read_all, args=(kernel,))
    reader.start()
    with pytest.raises(InvalidRequestError, match="integrity"):
        transfer.send(host, blob, lambda sha: False, threading.Event(), FOREVER)
    reader.join()


def test_each_parts_length_travels_with_its_member(tmp_path: Path) -> None:
    """What the kernel captures, the host stores and later sends back, the kernel reads
    with each part's length (so each out-of-band buffer gets a buffer of its own)."""
    kernel, host = socket.socketpair()
    writer = threading.Thread(
        target=write_members, args=(kernel, [("groups/g.pkl", [b"12", b"3456", b"7"])])
    )
    writer.start()
    transfer.receive(host, tmp_path / "blob", 1 << 20, threading.Event(), FOREVER)
    writer.join()
    host, kernel = socket.socketpair()
    sender = threading.Thread(
        target=transfer.send,
        args=(host, tmp_path / "blob", lambda sha: True, threading.Event(), FOREVER),
    )
    sender.start()
    got, said = read_all(kernel)
    sender.join()
    assert said and got == {"groups/g.pkl": (b"1234567", [2, 4, 1])}


async def test_alongside_prefers_the_streams_own_error() -> None:
    def too_big(stop: threading.Event) -> None:
        raise TooLargeError("larger than 1 bytes (KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES)")

    async def kernel_reports_broken_pipe() -> None:
        await asyncio.sleep(0)
        raise KernelError("BrokenPipeError")

    with pytest.raises(TooLargeError):
        await transfer.alongside(too_big, kernel_reports_broken_pipe())

    def waits(stop: threading.Event) -> None:
        assert stop.wait(10), "alongside did not stop the stream when the call failed"
        raise SandboxError("snapshot stream abandoned")

    with pytest.raises(KernelError):
        await transfer.alongside(waits, kernel_reports_broken_pipe())
