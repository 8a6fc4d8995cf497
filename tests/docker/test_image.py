"""The real kernel image, inspected and run: labels and config, the sandbox user, no
setuid/setgid file anywhere, the scientific stack importing under --network none and
--read-only from precompiled bytecode, the prebuilt font cache, nothing that builds or
installs software, and check_image refusing an image for another protocol."""

from __future__ import annotations

import io
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from kernelhub import KERNEL_PROTOCOL_VERSION, __version__
from kernelhub.config import load_settings
from kernelhub.errors import ImageBuildError, ImageError
from kernelhub.image import (
    KERNEL_COMMAND,
    KERNEL_PYTHON,
    LABEL_MANAGED,
    LABEL_PROTOCOL,
    LABEL_PYTHON,
    LABEL_ROLE,
    LABEL_VERSION,
    MPLCONFIG_SEED,
    SANDBOX_GID,
    SANDBOX_UID,
    WORKSPACE,
)
from kernelhub.image.build import ImageInfo, build_image, check_image, kernel_image_dir
from tests.conftest import RUN_INSTANCE, UNIT

# The session fixture may build the image (a few minutes from scratch); the tests are quick.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]
INSTANCE_LABEL = "org.kernelhub.instance"


@dataclass
class Run:
    status: int
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    client = docker.from_env(timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="session")
def kernel_image(docker_client: docker.DockerClient) -> ImageInfo:
    """The configured kernel image, built once with our builder if it is missing."""
    settings = load_settings()
    try:
        return check_image(docker_client, settings.docker.image)
    except ImageError:
        return build_image(settings, client=docker_client)


def run(
    client: docker.DockerClient,
    image: str,
    command: list[str],
    *,
    user: str | None = None,
    tmpfs: bool = True,
    drop_caps: bool = True,
) -> Run:
    """Run ``command`` the way a sandbox runs: no network, read-only root; wait; collect."""
    container = client.containers.create(
        image,
        command,
        user=user,
        network_mode="none",
        read_only=True,
        tmpfs={"/tmp": "rw,nosuid,nodev,size=64m"} if tmpfs else None,
        cap_drop=["ALL"] if drop_caps else None,
        security_opt=["no-new-privileges"],
        labels={INSTANCE_LABEL: RUN_INSTANCE},
    )
    try:
        container.start()
        status = container.wait(timeout=120 * UNIT)["StatusCode"]
        out = container.logs(stdout=True, stderr=False).decode(errors="replace")
        err = container.logs(stdout=False, stderr=True).decode(errors="replace")
        return Run(status, out, err)
    finally:
        container.remove(force=True)


def test_labels_and_config_follow_the_contract(
    docker_client: docker.DockerClient, kernel_image: ImageInfo
) -> None:
    attrs = docker_client.images.get(kernel_image.name).attrs
    labels = attrs["Config"]["Labels"]
    assert labels[LABEL_PROTOCOL] == KERNEL_PROTOCOL_VERSION
    assert labels[LABEL_VERSION] == __version__
    assert labels[LABEL_MANAGED] == "true"
    assert labels[LABEL_ROLE] == "kernel"
    assert labels[LABEL_PYTHON] == kernel_image.python_version
    config = attrs["Config"]
    assert config["User"] == f"{SANDBOX_UID}:{SANDBOX_GID}"
    assert config["WorkingDir"] == WORKSPACE
    assert config["Cmd"] == list(KERNEL_COMMAND)
    assert not config["Entrypoint"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["PYTHONPATH"] == "/opt/kernelhub"
    assert env["PATH"].startswith("/opt/kernel/bin:")


def test_check_image_accepts_the_built_image(
    docker_client: docker.DockerClient, kernel_image: ImageInfo
) -> None:
    info = check_image(docker_client, kernel_image.name)
    assert info.protocol == KERNEL_PROTOCOL_VERSION
    assert info.id.startswith("sha256:") and info.size_bytes > 0
    assert info.python_version is not None and info.python_version.startswith("3.")


def test_runs_as_the_sandbox_user_in_the_workspace(
    docker_client: docker.DockerClient, kernel_image: ImageInfo
) -> None:
    result = run(docker_client, kernel_image.name, ["sh", "-c", "id -u; id -g; pwd; echo $HOME"])
    assert result.status == 0, result.stderr
    assert result.stdout.split() == [str(SANDBOX_UID), str(SANDBOX_GID), WORKSPACE, WORKSPACE]


def test_no_setuid_or_setgid_file_anywhere(
    docker_client: docker.DockerClient, kernel_image: ImageInfo
) -> None:
    # As root with its capabilities, so no directory is unreadable to the walk.
    result = run(
        docker_client,
        kernel_image.name,
        ["find", "/", "-xdev", "-perm", "/6000", "-type", "f"],
        user="0",
        drop_caps=False,
    )
    assert result.status == 0, result.stderr
    assert result.stdout.strip() == ""


def test_scientific_stack_imports_without_network_on_a_read_only_root(
    docker_client: docker.DockerClient, kernel_image: ImageInfo
) -> None:
    # /tmp is the sandbox's tmpfs; dill needs a writable temp dir at import.
    result = run(
        docker_client,
        kernel_image.name,
        [KERNEL_PYTHON, "-c", "import ipykernel, dill, numpy, pandas, matplotlib; print('ok')"],
    )
    assert result.status == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_everything_the_kernel_imports_is_precompiled(
    docker_client: docker.DockerClient, kernel_image: ImageInfo
) -> None:
    # With PYTHONDONTWRITEBYTECODE and a read-only root, a missing or stale .pyc would be
    # compiled again on every kernel start.
    code = "import ipykernel.kernelapp, dill, numpy, pandas, matplotlib.pyplot, kernelhub_kernel"
    result = run(docker_client, kernel_image.name, [KERNEL_PYTHON, "-v", "-c", code])
    assert result.status == 0, result.stderr
    loaded = [line for line in result.stderr.splitlines() if line.startswith("# code object from")]
    assert len(loaded) > 300
    assert [line for line in loaded if ".pyc" not in line] == []


def test_the_prebuilt_font_cache_spares_matplotlib_a_rebuild(
    docker_client: docker.DockerClient, kernel_image: ImageInfo
) -> None:
    # The supervisor seeds MPLCONFIGDIR from MPLCONFIG_SEED at start; do the same here.
    plot = (
        "import io, matplotlib.pyplot as plt; plt.plot([1, 2, 3]); buf = io.BytesIO(); "
        "plt.gcf().savefig(buf, format='png'); print(buf.getvalue()[:4])"
    )
    result = run(
        docker_client,
        kernel_image.name,
        ["sh", "-c", f'cp -r {MPLCONFIG_SEED} "$MPLCONFIGDIR" && exec {KERNEL_PYTHON} -c "{plot}"'],
    )
    assert result.status == 0, result.stderr
    assert "PNG" in result.stdout
    assert "building the font cache" not in result.stderr


def test_nothing_that_builds_installs_or_escalates_is_on_board(
    docker_client: docker.DockerClient, kernel_image: ImageInfo
) -> None:
    tools = ["gcc", "cc", "make", "sudo", "curl", "wget"]
    # `pip` is kernelhub's own front door to uv (issue #25: installs into the session's
    # workspace, by policy), never pip itself: the script says so, and pip is not there.
    script = (
        f"for t in {' '.join(tools)}; do command -v $t; done; "
        "find /var/lib/apt/lists /var/cache/apt -type f; "
        "grep -L kernelhub_kernel.packages /opt/kernel/bin/pip /opt/kernel/bin/pip3; "
        f"test ! -e /opt/kernel/lib/python*/site-packages/pip && {KERNEL_PYTHON} -c 'import sys'"
    )
    result = run(docker_client, kernel_image.name, ["sh", "-c", script])
    assert result.status == 0, result.stderr
    assert result.stdout.strip() == ""


@pytest.fixture
def other_protocol_image(
    docker_client: docker.DockerClient, kernel_image: ImageInfo
) -> Iterator[str]:
    """The kernel image relabelled for protocol 0, built with no network; removed after."""
    tag = f"kernelhub-test/protocol0:{RUN_INSTANCE}"
    dockerfile = f"FROM {kernel_image.id}\nLABEL {LABEL_PROTOCOL}=0 {LABEL_VERSION}=0.0.0\n"
    image, _ = docker_client.images.build(
        fileobj=io.BytesIO(dockerfile.encode()),
        tag=tag,
        network_mode="none",
        pull=False,
        rm=True,
        forcerm=True,
        labels={INSTANCE_LABEL: RUN_INSTANCE},
    )
    try:
        yield tag
    finally:
        docker_client.images.remove(image.id, force=True)


def test_check_image_refuses_an_image_for_another_protocol(
    docker_client: docker.DockerClient, other_protocol_image: str
) -> None:
    with pytest.raises(ImageError) as info:
        check_image(docker_client, other_protocol_image)
    message = str(info.value)
    assert other_protocol_image in message
    assert "protocol '0'" in message
    assert f"protocol {KERNEL_PROTOCOL_VERSION!r}" in message
    assert "kernelhub image build" in message


def test_check_image_reports_a_missing_image(docker_client: docker.DockerClient) -> None:
    missing = f"kernelhub-test/missing:{RUN_INSTANCE}"
    with pytest.raises(ImageError, match="not found; build it with `kernelhub image build`"):
        check_image(docker_client, missing)


def test_the_build_has_no_network_and_a_failing_step_is_reported_with_its_output(
    tmp_path: Path, docker_client: docker.DockerClient, kernel_image: ImageInfo
) -> None:
    sources = tmp_path / "kernel-image"
    shutil.copytree(kernel_image_dir(), sources, ignore=shutil.ignore_patterns("__pycache__"))
    # 192.0.2.1 is TEST-NET-1: never routed, and without a network it is not even tried.
    (sources / "Dockerfile").write_text(
        "ARG BASE\nFROM ${BASE}\n"
        "RUN python3 -c 'import socket; socket.create_connection((\"192.0.2.1\", 9), timeout=5)'\n"
    )
    tag = f"kernelhub-test/failing:{RUN_INSTANCE}"
    lines: list[str] = []
    with pytest.raises(ImageBuildError) as info:
        build_image(
            load_settings(),  # the default data dir: its wheel cache makes this offline
            tag=tag,
            base=kernel_image.id,
            sources=sources,
            client=docker_client,
            progress=lines.append,
        )
    message = str(info.value)
    assert re.search(
        rf"docker build of {re.escape(tag)} failed at Step 3/\d+ : RUN python3 -c", message
    )
    assert "Network is unreachable" in message  # the step's own output, in the error
    assert any("Network is unreachable" in line for line in lines)  # and streamed live
    assert not docker_client.images.list(name=tag)
