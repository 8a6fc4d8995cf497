"""serve's checks before it starts (kernelhub/cli/serve.py): the Docker probe's few words
against real unix sockets that are not a daemon, and the first admin token made once,
in a real SqliteStore in a temporary data directory."""

from __future__ import annotations

import gc
import socket
import threading
from pathlib import Path

import pytest

from kernelhub.cli.serve import _short, bootstrap_token, probe_docker
from kernelhub.config import Settings
from kernelhub.store import open_store


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (FileNotFoundError(2, "No such file or directory"), "no socket there"),
        (
            OSError("('Connection aborted.', PermissionError(13, 'Permission denied'))"),
            "permission denied",
        ),
        (OSError("[Errno 111] Connection refused"), "connection refused"),
        (OSError("Read timed out. (read timeout=3)"), "timed out"),
        (OSError("first line\nsecond line"), "first line"),
        (OSError("x" * 300), "x" * 120),
        (OSError(), "OSError"),
    ],
)
def test_probe_failures_in_a_few_words(error: BaseException, said: str) -> None:
    assert _short(error) == said


# The docker library leaves its failed connection's socket to the garbage collector.
leaks = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@leaks
def test_no_socket_at_the_docker_address(tmp_path: Path) -> None:
    where = f"unix://{tmp_path / 'docker.sock'}"
    probe = probe_docker(where)
    gc.collect()  # the leaked socket warns here, where it is ignored, not in a later test
    assert (probe.where, probe.problem) == (where, "no socket there")


@leaks
def test_a_socket_that_is_not_a_daemon_is_down_not_up(tmp_path: Path) -> None:
    path = tmp_path / "not-docker.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()

    def hang_up() -> None:  # accept each connection and close it at once
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    try:
        probe = probe_docker(f"unix://{path}")
    finally:
        server.close()
    gc.collect()
    assert probe.problem is not None and probe.problem != "no socket there"


async def test_the_first_admin_token_is_made_once(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    first = await bootstrap_token(settings)
    assert first
    assert await bootstrap_token(settings) is None  # tokens exist: none is shown again
    store = await open_store(settings)
    try:
        tokens = await store.list_tokens()
        assert [(t.name, t.admin) for t in tokens] == [("admin", True)]
        principal = await store.principal_for(first)
        assert principal is not None and (principal.name, principal.admin) == ("admin", True)
    finally:
        await store.close()
