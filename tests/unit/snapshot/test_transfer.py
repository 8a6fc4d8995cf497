"""The host's half of a snapshot stream with real unix sockets in a real socket directory:
it waits for the kernel's socket to appear and to listen (a name bound a moment before
``listen`` is retried), gives up at its deadline or when told to, refuses a planted
symlink, and a push through ``alongside`` hands the kernel length, bytes and the verdict
that ``mac_check`` gives."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from pydantic import SecretStr

from kernelhub.errors import InvalidRequestError, SandboxError, TooLargeError, UnsafeSocketError
from kernelhub.kernel.connection import SessionDir
from kernelhub.snapshot.transfer import (
    CHUNK,
    VERDICT_OK,
    VERDICT_REFUSED,
    algorithm_of,
    alongside,
    connect,
    default_algorithm,
    labelled,
    mac_check,
    new_digest,
    pull,
    push,
)
from tests.conftest import UNIT


@pytest.fixture
def session_dir(tmp_path: Path) -> SessionDir:
    (tmp_path / "ipc").mkdir()
    return SessionDir(tmp_path, os.geteuid(), SecretStr("k"))


def bound(session_dir: SessionDir, name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(session_dir.ipc_dir / name))
    return sock


def test_a_socket_bound_before_it_listens_is_retried_until_it_does(
    session_dir: SessionDir,
) -> None:
    kernel = bound(session_dir, "snap-1")
    listening = threading.Timer(0.05, kernel.listen)
    listening.start()
    try:
        sock = connect(session_dir, "snap-1", time.monotonic() + 5 * UNIT, threading.Event())
        sock.close()
    finally:
        listening.cancel()
        kernel.close()


def test_no_socket_by_the_deadline_names_the_stream(session_dir: SessionDir) -> None:
    with pytest.raises(SandboxError, match=r"did not open its snapshot stream 'snap-2' in time"):
        connect(session_dir, "snap-2", time.monotonic() + 0.05, threading.Event())


def test_a_stop_ends_the_wait(session_dir: SessionDir) -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(SandboxError, match="abandoned before the kernel opened it"):
        connect(session_dir, "snap-3", time.monotonic() + 60, stop)


def test_a_planted_symlink_is_refused(session_dir: SessionDir, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("")
    (session_dir.ipc_dir / "snap-4").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeSocketError, match="snap-4"):
        connect(session_dir, "snap-4", time.monotonic() + 5, threading.Event())


def test_the_verdict_needs_both_the_mac_and_the_hash() -> None:
    def mac_of(sha: str) -> str:
        return hashlib.sha256(b"key" + sha.encode()).hexdigest()

    accept = mac_check("aa", mac_of, mac_of("aa"))
    assert accept("aa")
    assert not accept("bb")  # other bytes than were stored
    assert not mac_check("aa", mac_of, mac_of("bb"))("aa")  # a MAC for another blob
    assert not mac_check("bb", mac_of, mac_of("aa"))("aa")  # the row says other bytes


def _kernel_reads(kernel: socket.socket) -> bytes:
    """The kernel's side of a restore: everything the host sends, until it shuts down."""
    conn, _ = kernel.accept()
    with conn:
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("intact", [True, False])
async def test_a_push_sends_length_bytes_and_the_verdict(
    session_dir: SessionDir, tmp_path: Path, intact: bool
) -> None:
    blob = os.urandom(300_000)
    source = tmp_path / "blob"
    source.write_bytes(blob)
    stored_sha = hashlib.sha256(blob if intact else b"something else").hexdigest()
    kernel = bound(session_dir, "snap-5")
    kernel.listen()
    try:
        run = push(session_dir, "snap-5", source, lambda sha: sha == stored_sha, 10 * UNIT)
        if intact:
            sent, got = await alongside(run, asyncio.to_thread(_kernel_reads, kernel))
            assert sent == len(blob)
        else:
            reading = asyncio.ensure_future(asyncio.to_thread(_kernel_reads, kernel))
            with pytest.raises(InvalidRequestError, match="integrity check"):
                await alongside(run, asyncio.shield(reading))
            got = await reading
    finally:
        kernel.close()
    verdict = VERDICT_OK if intact else VERDICT_REFUSED
    assert got == len(blob).to_bytes(8, "big") + blob + verdict


async def test_a_kernel_that_fails_stops_the_stream(session_dir: SessionDir) -> None:
    """The kernel reports an error before it ever listens: the host stops waiting for the
    socket at once (not at its deadline) and the kernel's error is what the caller sees."""
    seen: list[float] = []

    def blocking(stop: threading.Event) -> None:
        t0 = time.monotonic()
        try:
            connect(session_dir, "snap-6", time.monotonic() + 60, stop)
        finally:
            seen.append(time.monotonic() - t0)

    async def kernel() -> None:
        await asyncio.sleep(0.02)
        raise RuntimeError("the kernel could not pickle a frame")

    with pytest.raises(RuntimeError, match="could not pickle"):
        await alongside(blocking, kernel())
    assert seen and seen[0] < 5 * UNIT


def _kernel_sends(kernel: socket.socket, data: bytes, piece: int) -> None:
    """The kernel's side of a capture: ``data`` in writes of ``piece`` bytes, then EOF."""
    conn, _ = kernel.accept()
    with conn:
        for offset in range(0, len(data), piece):
            conn.sendall(data[offset : offset + piece])


@pytest.mark.parametrize("size", [0, 5, CHUNK, 2 * CHUNK + 12_345])
async def test_a_pull_writes_every_byte_and_its_one_digest(
    session_dir: SessionDir, tmp_path: Path, size: int
) -> None:
    data = os.urandom(size)
    kernel = bound(session_dir, "snap-7")
    kernel.listen()
    target = tmp_path / "blob"
    try:
        run = pull(session_dir, "snap-7", target, 1 << 30, 10 * UNIT)
        (got, digest), _ = await alongside(
            run, asyncio.to_thread(_kernel_sends, kernel, data, 777_777)
        )
    finally:
        kernel.close()
    assert got == size and target.read_bytes() == data
    algorithm = default_algorithm()
    assert algorithm_of(digest) == algorithm
    expected = new_digest(algorithm)
    expected.update(memoryview(data))
    assert digest == labelled(algorithm, expected)
    # The restore hashes the file with the algorithm the stored digest names, so a blob
    # made before (bare SHA-256) verifies as it did, and this one verifies too.
    for i, stored in enumerate((digest, hashlib.sha256(data).hexdigest())):
        sock = bound(session_dir, f"snap-8{i}")
        sock.listen()
        try:
            push_run = push(
                session_dir, f"snap-8{i}", target, lambda d, s=stored: d == s, 10 * UNIT,
                algorithm_of(stored),
            )  # fmt: skip
            sent, _ = await alongside(push_run, asyncio.to_thread(_kernel_reads, sock))
        finally:
            sock.close()
        assert sent == size


async def test_a_pull_past_the_cap_is_too_large_and_leaves_no_file(
    session_dir: SessionDir, tmp_path: Path
) -> None:
    kernel = bound(session_dir, "snap-9")
    kernel.listen()
    target = tmp_path / "blob"
    try:
        run = pull(session_dir, "snap-9", target, 3 << 20, 10 * UNIT)
        sending = asyncio.ensure_future(
            asyncio.to_thread(_kernel_sends, kernel, bytes(8 << 20), 1 << 20)
        )
        with pytest.raises(TooLargeError, match="MAX_SNAPSHOT_BYTES"):
            await alongside(run, asyncio.shield(sending))
        with contextlib.suppress(OSError):
            await sending  # the host hung up on it
    finally:
        kernel.close()
    assert not target.exists()
