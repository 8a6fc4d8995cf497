from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from kernelhub.errors import UnsafeSocketError
from kernelhub.kernel.connection import PORTS, SOCKET_PREFIX, SessionDir


def make_dir(tmp_path: Path) -> SessionDir:
    return SessionDir.create(
        tmp_path / "abc123",
        sandbox_uid=os.geteuid(),
        sandbox_gid=os.getegid(),
        labels={"org.kernelhub.session": "abc123"},
        kernel_ipc_prefix="/run/kernelhub/ipc/k",
    )


def bind_all(sdir: SessionDir) -> list[socket.socket]:
    socks = []
    for port in PORTS.values():
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(sdir.ipc_dir / f"{SOCKET_PREFIX}-{port}"))
        socks.append(s)
    return socks


def test_connection_file_is_written_once_read_only_with_a_fresh_key(tmp_path: Path) -> None:
    a = make_dir(tmp_path)
    info = json.loads(a.connection_file.read_text())
    assert info["transport"] == "ipc" and info["ip"] == "/run/kernelhub/ipc/k"
    assert info["key"] == a.key.get_secret_value()
    assert stat.S_IMODE(a.connection_file.stat().st_mode) == 0o400
    assert a.key.get_secret_value() not in repr(a)
    b = SessionDir.create(
        tmp_path / "def456", sandbox_uid=os.geteuid(), sandbox_gid=os.getegid(), labels={}
    )
    assert a.key.get_secret_value() != b.key.get_secret_value()
    assert json.loads((a.root / "labels.json").read_text()) == {"org.kernelhub.session": "abc123"}


def test_real_sockets_are_accepted(tmp_path: Path) -> None:
    sdir = make_dir(tmp_path)
    socks = bind_all(sdir)
    assert sdir.sockets_present()
    fds = sdir.open_sockets()
    try:
        assert set(fds) == set(PORTS)
    finally:
        for fd in fds.values():
            os.close(fd)
        for s in socks:
            s.close()


@pytest.mark.parametrize("plant", ["symlink", "file", "fifo"])
def test_anything_but_our_socket_is_refused(tmp_path: Path, plant: str) -> None:
    sdir = make_dir(tmp_path)
    socks = bind_all(sdir)
    victim = sdir.ipc_dir / f"{SOCKET_PREFIX}-{PORTS['shell']}"
    victim.unlink()
    target = tmp_path / "host-secret.sock"
    host = socket.socket(socket.AF_UNIX)
    host.bind(str(target))
    socks.append(host)
    if plant == "symlink":
        victim.symlink_to(target)
    elif plant == "file":
        victim.write_text("x")
    else:
        os.mkfifo(victim)
    with pytest.raises(UnsafeSocketError):
        sdir.open_sockets()
    for s in socks:
        s.close()


def test_socket_of_another_uid_is_refused(tmp_path: Path) -> None:
    sdir = make_dir(tmp_path)
    socks = bind_all(sdir)
    sdir.sandbox_uid = os.geteuid() + 1
    with pytest.raises(UnsafeSocketError, match="owned by uid"):
        sdir.open_sockets()
    for s in socks:
        s.close()


def test_remove_does_not_follow_planted_symlinks(tmp_path: Path) -> None:
    sdir = make_dir(tmp_path)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep me")
    (sdir.ipc_dir / "evil").symlink_to(precious)
    sdir.remove()
    assert not sdir.root.exists()
    assert (precious / "data").read_text() == "keep me"
