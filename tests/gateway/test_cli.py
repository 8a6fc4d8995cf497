"""The CLI against a real gateway and real Docker sandboxes, as a person would use it:
a session that stays (new → exec --session → show → export → rm), exec --keep, output to a
terminal, and serve's first start (token only once it serves, one-line failures)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RUN_INSTANCE, UNIT
from tests.gateway.conftest import Gateway, free_port, gateway_run_dir, remove_sandboxes

pytestmark = pytest.mark.docker


def kh(
    env: dict[str, str], *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kernelhub.cli", *args],
        env=env, input=stdin, capture_output=True, text=True, timeout=120 * UNIT,
    )  # fmt: skip


def ok(env: dict[str, str], *args: str) -> str:
    out = kh(env, *args)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One gateway for the client tests; each has a token of its own, so sees only its
    own sessions."""
    gw = Gateway(tmp_path_factory.mktemp("cli") / "data", gateway_run_dir())
    gw.start()
    yield gw
    gw.stop()
    remove_sandboxes()


def client_env(gateway: Gateway) -> dict[str, str]:
    token = gateway.token(f"u{uuid.uuid4().hex[:8]}")
    return {**gateway.env, "KERNELHUB_URL": gateway.url, "KERNELHUB_TOKEN": token}


def test_a_session_that_stays_new_exec_show_export_rm(shared: Gateway, tmp_path: Path) -> None:
    env = client_env(shared)
    sid = ok(env, "sessions", "new", "--meta", "job=cli").strip()
    assert sid and "\n" not in sid
    assert ok(env, "exec", "--session", sid, "x = 6 * 7").startswith("[completed")
    assert ok(env, "exec", "--session", sid, "print(x)").startswith("42\n")

    shown = ok(env, "sessions", "show", sid)
    assert (
        f"id:            {sid}" in shown and "state:         ready" in shown and "job=cli" in shown
    )
    info = json.loads(ok(env, "sessions", "show", sid, "--json"))
    assert info["id"] == sid and info["last_seq"] > 0
    listed = json.loads(ok(env, "sessions", "ls", "--json"))
    assert [s["id"] for s in listed] == [sid]
    table = ok(env, "sessions", "ls").splitlines()
    assert table[0].split()[:2] == ["ID", "STATE"] and table[1].startswith(sid)

    notebook = tmp_path / "s.ipynb"
    assert ok(env, "sessions", "export", sid, "-o", str(notebook)).strip() == f"wrote {notebook}"
    cells = json.loads(notebook.read_text())["cells"]
    assert ["".join(c["source"]) for c in cells if c["cell_type"] == "code"] == [
        "x = 6 * 7",
        "print(x)",
    ]
    html = tmp_path / "s.html"
    ok(env, "sessions", "export", sid, "--html", "-o", str(html))
    assert "print(x)" in html.read_text()

    assert ok(env, "sessions", "rm", sid).strip() == f"deleted {sid}"
    assert ok(env, "sessions", "ls").strip() == "no sessions"
    assert json.loads(ok(env, "sessions", "ls", "--json")) == []
    # A deleted session is shown as such, or refused as ended (410): in one line either way.
    after = kh(env, "sessions", "show", sid)
    if after.returncode == 0:
        assert "state:         deleted" in after.stdout
    else:
        assert after.stderr.count("\n") == 1 and "kernelhub sessions new" in after.stderr
    gone = kh(env, "sessions", "show", "nosuchsession")
    assert gone.returncode == 1 and gone.stdout == ""
    assert gone.stderr.count("\n") == 1 and "kernelhub sessions ls" in gone.stderr
    assert "Traceback" not in gone.stderr and "hub." not in gone.stderr


def test_exec_keep_prints_the_id_and_the_session_stays(shared: Gateway) -> None:
    env = client_env(shared)
    out = ok(env, "exec", "--keep", "y = 'kept'")
    first = out.splitlines()[0]
    assert first.startswith("session ")
    sid = first.split()[1]
    assert ok(env, "exec", "--session", sid, "print(y)").startswith("kept\n")
    # A plain exec deletes its throwaway session.
    ok(env, "exec", "print(1)")
    assert [s["id"] for s in json.loads(ok(env, "sessions", "ls", "--json"))] == [sid]
    record = json.loads(ok(env, "exec", "--session", sid, "--json", "print(y * 2)"))
    assert record["session_id"] == sid and record["record"]["status"] == "completed"
    ok(env, "sessions", "rm", sid)


def _on_a_terminal(env: dict[str, str], *args: str) -> bytes:
    """Run the CLI with its stdout on a pseudo-terminal; everything it wrote there."""
    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", "kernelhub.cli", *args]
    with subprocess.Popen(cmd, env=env, stdout=slave, stderr=subprocess.PIPE) as proc:
        os.close(slave)
        chunks: list[bytes] = []
        deadline = time.monotonic() + 60 * UNIT
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the other side closed
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        os.close(master)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
    return b"".join(chunks)


EVIL = (
    r"print('\x1b]52;c;cm0gLXJmIH4=\x07\x1b]8;;https://evil.example/\x1b\\ok\x1b]8;;\x1b\\"
    r"\x1b[2J\x1b[31mred\x1b[0m')"
)


def test_sandbox_output_cannot_command_the_readers_terminal(shared: Gateway) -> None:
    env = client_env(shared)
    sid = ok(env, "sessions", "new").strip()
    seen = _on_a_terminal(env, "exec", "--session", sid, EVIL)
    assert b"ok\x1b[31mred\x1b[0m" in seen
    for command in (b"\x1b]52", b"\x1b]8", b"\x1b[2J"):
        assert command not in seen
    raw = _on_a_terminal(env, "exec", "--session", sid, "--raw", EVIL)
    assert b"\x1b]52;c;cm0gLXJmIH4=\x07" in raw and b"\x1b[2J" in raw
    ok(env, "sessions", "rm", sid)


# ----------------------------------------------------------------------- serve


def _serve_env(tmp_path: Path, port: int, **extra: str) -> dict[str, str]:
    gw = Gateway(tmp_path / "data", gateway_run_dir())
    return {**gw.env, "KERNELHUB_GATEWAY__PORT": str(port), **extra}


def test_a_serve_that_cannot_bind_makes_no_token_and_prints_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _serve_env(tmp_path, port)
        out = kh(env, "serve")
    assert out.returncode == 1 and out.stdout == "" and "kh_" not in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr
    assert ok(env, "token", "list").strip() == "no tokens"


def test_serve_with_docker_asked_for_and_down_is_one_line_and_no_token(tmp_path: Path) -> None:
    env = _serve_env(tmp_path, free_port(), DOCKER_HOST=f"unix://{tmp_path}/no-docker.sock")
    out = kh(env, "serve", "--backend", "docker")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert f"not reachable at unix://{tmp_path}/no-docker.sock" in out.stderr
    assert "systemctl start docker" in out.stderr or "apt-get install" in out.stderr
    assert ok(env, "token", "list").strip() == "no tokens"


def _wait_for_line(log: Path, needle: str, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout * UNIT
    while needle not in (text := log.read_text()):
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.05)
    return text.splitlines()


def test_first_start_token_comes_after_the_gateway_serves_and_later_starts_say_how(
    tmp_path: Path,
) -> None:
    # Its own instance label: the shared gateway may still run; this one makes no sandboxes.
    gateway = Gateway(
        tmp_path / "data", gateway_run_dir(), KERNELHUB_GATEWAY__INSTANCE=f"{RUN_INSTANCE}-first"
    )
    gateway.start()
    try:
        _first_and_second_start(gateway)
    finally:
        gateway.stop()


def _first_and_second_start(gateway: Gateway) -> None:
    lines = _wait_for_line(gateway.log, "created admin token")
    serving = next(
        i for i, line in enumerate(lines) if line.startswith("kernelhub gateway on http://")
    )
    token_at = next(
        i for i, line in enumerate(lines) if "created admin token 'admin' (shown once): kh_" in line
    )
    assert (
        next(i for i, line in enumerate(lines) if line.startswith("backend: docker"))
        < serving
        < token_at
    )
    assert any(line.startswith("isolation: one locked-down container") for line in lines)
    token = lines[token_at].rsplit(" ", 1)[1]
    env = {**gateway.env, "KERNELHUB_URL": gateway.url, "KERNELHUB_TOKEN": token}
    assert ok(env, "sessions", "ls").strip() == "no sessions"
    gateway.stop()
    gateway.start()
    lines = _wait_for_line(gateway.log, "tokens exist already")
    assert sum("created admin token" in line for line in lines) == 1
    assert any("kernelhub token create --admin --name NAME" in line for line in lines)


def test_serve_no_build_with_the_image_missing_says_how_to_build_it(tmp_path: Path) -> None:
    image = f"kernelhub/kernel:missing-{os.getpid()}"
    env = _serve_env(tmp_path, free_port(), KERNELHUB_DOCKER__IMAGE=image)
    out = kh(env, "serve", "--no-build")
    assert out.returncode == 1 and "Traceback" not in out.stderr and "kh_" not in out.stdout
    assert out.stderr.count("\n") == 1 and image in out.stderr
    assert "kernelhub image build" in out.stderr


@pytest.mark.timeout(900)
def test_serve_builds_a_missing_kernel_image_on_first_use_quietly(tmp_path: Path) -> None:
    import docker

    image = f"kernelhub/kernel:first-use-{os.getpid()}"
    env = _serve_env(tmp_path, free_port(), KERNELHUB_DOCKER__IMAGE=image)
    log = tmp_path / "serve.log"
    try:
        with log.open("wb") as out:
            serve = subprocess.Popen(
                [sys.executable, "-m", "kernelhub.cli", "serve"], env=env, stdout=out, stderr=subprocess.STDOUT
            )  # fmt: skip
        try:
            lines = _wait_for_line(log, "created admin token", timeout=600)
        finally:
            serve.terminate()
            serve.wait(60)
        assert f"kernel image {image} not found; building it (first use)" in lines
        stages = [line for line in lines if line.startswith("✓ [")]
        assert [s.split("]")[0] for s in stages] == ["✓ [1/4", "✓ [2/4", "✓ [3/4", "✓ [4/4"]
        built = next(line for line in lines if line.startswith(f"built {image} "))
        build_log = Path(built.rsplit("build log: ", 1)[1])
        tool_lines = build_log.read_text().splitlines()
        # The tools' output is in the log, not on the screen.
        assert len(tool_lines) > 2 * len(lines) and not any(t.startswith("Step ") for t in lines)
        assert any(t.startswith("Step ") for t in tool_lines)
        assert lines.index(built) < next(
            i for i, line in enumerate(lines) if line.startswith("kernelhub gateway on")
        )
    finally:
        client = docker.from_env()
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(image, force=True)  # untag even if a container used it
        client.close()
