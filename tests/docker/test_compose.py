"""compose.yaml as Docker Compose reads it: ``docker-compose config`` (Debian's 1.29, or the
``docker compose`` plugin) accepts it, and in the resolved configuration the gateway's port
is published on the host's loopback only, the socket directory is mounted at the same path
inside and outside (the daemon resolves the kernel containers' bind sources on the host),
the Docker socket is mounted, and the image is the one ``kernelhub image build-gateway``
tags. The pure reading of port and volume entries is shared with the unit tier."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelhub.image.gateway import gateway_tag
from tests.conftest import UNIT

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
DOCKER_SOCKET = "/var/run/docker.sock"


@dataclass(frozen=True)
class Published:
    host_ip: str | None  # None: every interface
    published: str | None  # None: a port the daemon picks
    target: str
    protocol: str


@dataclass(frozen=True)
class Volume:
    source: str | None
    target: str
    read_only: bool

    @property
    def is_bind(self) -> bool:
        return self.source is not None and self.source.startswith("/")


def published_ports(service: Mapping[str, Any]) -> list[Published]:
    """A service's ``ports``, in short (``"127.0.0.1:8765:8765/tcp"``) or long syntax."""
    result = []
    for entry in service.get("ports") or []:
        if isinstance(entry, Mapping):
            result.append(
                Published(
                    host_ip=entry.get("host_ip") or None,
                    published=str(entry["published"]) if entry.get("published") else None,
                    target=str(entry["target"]),
                    protocol=str(entry.get("protocol") or "tcp"),
                )
            )
            continue
        spec, _, protocol = str(entry).partition("/")
        parts = spec.rsplit(":", 2)
        host_ip = parts[0] if len(parts) == 3 else None
        published = parts[-2] if len(parts) >= 2 else None
        result.append(Published(host_ip, published, parts[-1], protocol or "tcp"))
    return result


def volumes(service: Mapping[str, Any]) -> list[Volume]:
    """A service's ``volumes``, in short (``"/src:/dst:ro"``) or long syntax."""
    result = []
    for entry in service.get("volumes") or []:
        if isinstance(entry, Mapping):
            result.append(
                Volume(
                    source=entry.get("source"),
                    target=str(entry["target"]),
                    read_only=bool(entry.get("read_only")),
                )
            )
            continue
        parts = str(entry).split(":")
        if len(parts) == 1:  # an anonymous volume
            result.append(Volume(None, parts[0], False))
            continue
        mode = parts[2].split(",") if len(parts) > 2 else []
        result.append(Volume(parts[0], parts[1], "ro" in mode))
    return result


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's ``environment``, as a mapping or as a ``KEY=value`` list."""
    env = service.get("environment") or {}
    if isinstance(env, Mapping):
        return {str(k): "" if v is None else str(v) for k, v in env.items()}
    return dict(str(item).partition("=")[::2] for item in env)


def compose_command() -> list[str] | None:
    """Debian's ``docker-compose``, else the ``docker compose`` plugin, else None."""
    standalone = shutil.which("docker-compose")
    if standalone is not None:
        return [standalone]
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=30 * UNIT
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    return None


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """compose.yaml resolved by Docker Compose itself."""
    command = compose_command()
    if command is None:
        reason = (
            "neither docker-compose nor the docker compose plugin is installed, so "
            "compose.yaml cannot be validated; install Debian's with "
            "`apt-get install -y docker-compose`"
        )
        if os.environ.get("KERNELHUB_REQUIRE_DOCKER") == "1":
            pytest.fail(f"KERNELHUB_REQUIRE_DOCKER=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    result = subprocess.run(
        [*command, "-f", str(COMPOSE_FILE), "config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60 * UNIT,
    )
    assert result.returncode == 0, (
        f"{' '.join(command)} config rejected compose.yaml:\n{result.stderr}"
    )
    parsed = yaml.safe_load(result.stdout)
    assert isinstance(parsed, dict)
    return parsed


@pytest.fixture(scope="module")
def gateway(config: dict[str, Any]) -> dict[str, Any]:
    service = config["services"]["gateway"]
    assert isinstance(service, dict)
    return service


def test_the_gateway_image_is_the_one_the_builder_tags(gateway: dict[str, Any]) -> None:
    assert gateway["image"] == gateway_tag()


def test_every_published_port_is_on_the_host_loopback_only(config: dict[str, Any]) -> None:
    for name, service in config["services"].items():
        for port in published_ports(service):
            assert port.host_ip == "127.0.0.1", f"service {name} publishes {port} beyond loopback"
    gateway = published_ports(config["services"]["gateway"])
    assert [(p.published, p.target) for p in gateway] == [("8765", "8765")]


def test_the_gateway_listens_on_every_interface_inside_its_container(
    gateway: dict[str, Any],
) -> None:
    env = environment(gateway)
    assert env["KERNELHUB_GATEWAY__HOST"] == "0.0.0.0"
    assert env.get("KERNELHUB_GATEWAY__PORT", "8765") == "8765"


def test_the_run_dir_is_mounted_at_the_identical_path(gateway: dict[str, Any]) -> None:
    run_dir = environment(gateway)["KERNELHUB_RUN_DIR"]
    mounts = [v for v in volumes(gateway) if v.target == run_dir]
    assert len(mounts) == 1, f"KERNELHUB_RUN_DIR={run_dir} is not mounted exactly once"
    assert mounts[0].source == run_dir, "sibling kernels mount it by the host path"
    assert not mounts[0].read_only


def test_the_docker_socket_is_mounted(gateway: dict[str, Any]) -> None:
    assert Volume(DOCKER_SOCKET, DOCKER_SOCKET, False) in volumes(gateway)


def test_cgroups_are_mounted_read_only_and_data_persists(gateway: dict[str, Any]) -> None:
    mounts = {v.target: v for v in volumes(gateway)}
    assert mounts["/sys/fs/cgroup"] == Volume("/sys/fs/cgroup", "/sys/fs/cgroup", True)
    data = mounts[environment(gateway)["KERNELHUB_DATA_DIR"]]
    assert data.source is not None and not data.read_only


FALLBACK_PROBE = """
import asyncio, json, os, sys, uuid
from pathlib import Path
from kernelhub.config import Limits
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.base import SandboxSpec
from kernelhub.sandbox.docker import DockerBackend

async def main():
    backend = DockerBackend(image=sys.argv[1], run_dir=Path(sys.argv[2]), instance=sys.argv[3])
    spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], limits=Limits(tmp_bytes=8 * 2**20))
    session = await KernelSession.start(backend, spec)
    try:
        code = (
            "import errno\\nn = 0\\ntry:\\n"
            "    with open('/tmp/.kernelhub/fill', 'wb') as f:\\n"
            "        for _ in range(32): f.write(b'x' * 2**20); f.flush(); n += 2**20\\n"
            "except OSError as e:\\n    print(n, errno.errorcode[e.errno])\\n"
        )
        result = await session.execute(code, timeout=60)
        state = backend.run_dir / f"{spec.session_id}.state"
        ipc = session.sandbox.session_dir.ipc_dir
        print(json.dumps({"out": result.stdout, "state_on_host": state.exists(),
                          "ipc_mounted": os.path.ismount(ipc)}))
    finally:
        await session.close()
        await backend.close()

asyncio.run(main())
"""


def test_without_mount_rights_the_state_dir_is_still_capped(tmp_path: Path) -> None:
    """As under compose: root in a container without CAP_SYS_ADMIN cannot mount the
    state tmpfs. The sandbox then gets a capped tmpfs of Docker's, never an uncapped host
    directory. (The gateway is run here with the capability dropped, which is what the
    container does to it.)"""
    capsh = shutil.which("capsh")
    if os.geteuid() != 0 or capsh is None:
        pytest.skip("needs root and capsh (`apt-get install -y libcap2-bin`) to drop CAP_SYS_ADMIN")
    from kernelhub.config import load_settings
    from tests.conftest import RUN_INSTANCE

    settings = load_settings()
    run_dir = "/run/kernelhub-test"
    probe = tmp_path / "probe.py"
    probe.write_text(FALLBACK_PROBE)
    result = subprocess.run(
        [capsh, "--drop=cap_sys_admin", "--", "-c",
         'exec "$0" "$@"', sys.executable, str(probe), settings.docker.image, run_dir,
         f"{RUN_INSTANCE}c"],
        capture_output=True, text=True, timeout=120 * UNIT, env={**os.environ},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    written, err = report["out"].split()
    assert err == "ENOSPC" and int(written) <= 8 * 2**20, report
    assert report["state_on_host"] is False, "fell back to an uncapped host directory"
    assert "cannot mount a capped tmpfs" in result.stderr


def _serve_without_mount_rights(
    capsh: str, run_dir: Path, data_dir: Path, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    from tests.conftest import RUN_INSTANCE
    from tests.gateway.conftest import free_port

    port = free_port()
    env = {
        **os.environ,
        "KERNELHUB_BACKEND": "docker",
        "KERNELHUB_DATA_DIR": str(data_dir),
        "KERNELHUB_RUN_DIR": str(run_dir),
        "KERNELHUB_GATEWAY__PORT": str(port),
        "KERNELHUB_GATEWAY__INSTANCE": f"{RUN_INSTANCE}r",
        "KERNELHUB_POOL__SIZE": "0",
    }
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [capsh, "--drop=cap_sys_admin", "--", "-c", 'exec "$0" "$@"',
             sys.executable, "-m", "kernelhub.cli", "serve"],
            env=env, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def test_without_mount_rights_serve_refuses_an_uncapped_run_dir(tmp_path: Path) -> None:
    """As under compose, where the socket directories cannot be capped tmpfs mounts of
    their own: on a run directory as large as the host's disk (or its /run), what a
    sandbox writes into its socket directory fills the host. serve refuses that before
    any sandbox starts, naming the knob; on a small tmpfs it serves."""
    capsh = shutil.which("capsh")
    if os.geteuid() != 0 or capsh is None:
        pytest.skip("needs root and capsh (`apt-get install -y libcap2-bin`) to drop CAP_SYS_ADMIN")
    from tests.gateway.conftest import wait_until_up

    log = tmp_path / "refused.log"
    refused, _ = _serve_without_mount_rights(capsh, tmp_path / "run", tmp_path / "data", log)
    try:
        refused.wait(timeout=45 * UNIT)
    except subprocess.TimeoutExpired:
        refused.kill()
        refused.wait()
        pytest.fail(f"serve started on an uncapped run dir: {log.read_text()[-3000:]}")
    out = log.read_text()
    assert refused.returncode != 0, out[-3000:]
    assert "may not mount a capped tmpfs" in out and "KERNELHUB_DOCKER__RUN_DIR_MAX_BYTES" in out
    capped = tmp_path / "capped"
    capped.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0711", "kernelhub-test", str(capped)],
        check=True, timeout=30,
    )  # fmt: skip
    try:
        log = tmp_path / "served.log"
        served, url = _serve_without_mount_rights(capsh, capped, tmp_path / "data2", log)
        try:
            wait_until_up(served, f"{url}/readyz", log)
        finally:
            served.terminate()
            served.wait(60)
    finally:
        subprocess.run(["umount", "-l", str(capped)], check=False, timeout=30)
