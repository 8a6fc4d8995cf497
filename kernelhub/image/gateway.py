"""Building the gateway's own image (``kernelhub image build-gateway``), for compose.yaml.

:func:`build_gateway_image` is the entry point the CLI calls. Like the kernel image it
never contacts a container registry and the docker build has no network:

    base image       the local debootstrapped base (made with debootstrap if missing), or
                     the ``base`` the caller names; probed for its Python and glibc
    wheels           ``gateway-image/requirements.txt`` (the locked closure of
                     ``kernelhub[server,postgres]``) downloaded on the host for that platform,
                     cached like the kernel image's (:mod:`kernelhub.image.wheels`)
    kernelhub wheel  ``pip wheel --no-deps`` of the source checkout, built fresh each time
    docker build     ``gateway-image/Dockerfile``, network disabled, ``--no-index`` install
    check            the labels, then one run of the image (no network) importing the
                     gateway and the docker backend

Building needs a source checkout (``pyproject.toml`` and ``gateway-image/``): kernelhub's
own wheel is made from it. The pure parts (:func:`pip_wheel_command`,
:func:`kernelhub_wheel`, :func:`find_source_checkout`, :func:`write_gateway_context`,
:func:`gateway_labels`) are unit-tested; raises only :mod:`kernelhub.errors` types.
"""

from __future__ import annotations

import re
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import docker
import docker.errors
from pydantic import BaseModel, ConfigDict

import kernelhub
from kernelhub.config import Settings, load_settings
from kernelhub.errors import ImageBuildError
from kernelhub.image import DEBIAN_MIRROR, LABEL_MANAGED, LABEL_ROLE, LABEL_VERSION
from kernelhub.image.base import probe_platform
from kernelhub.image.build import (
    BaseChoice,
    _current_id,
    _docker_build,
    _settle_build,
    docker_client,
    resolve_base,
)
from kernelhub.image.docker_errors import docker_errors
from kernelhub.image.process import format_tail, run_streaming
from kernelhub.image.wheels import download_wheels

#: The gateway image's repository; the tag is kernelhub's version (compose.yaml names it).
GATEWAY_REPOSITORY = "kernelhub/gateway"
#: Where the image's venv lives; ``kernelhub`` is on ``PATH`` from there.
GATEWAY_VENV = "/opt/gateway"
#: The source checkout's directory holding the Dockerfile and the lock.
GATEWAY_IMAGE_DIR = "gateway-image"
#: Run in the built image (no network, read-only) to prove the server stack imports.
#: Prints kernelhub's version and the Python version, space-separated.
SMOKE_SCRIPT = (
    "import sys, kernelhub, kernelhub.gateway.app, kernelhub.sandbox.docker; "
    "print(kernelhub.__version__, '%d.%d' % sys.version_info[:2])"
)

_WHEEL_NAME = re.compile(r"^kernelhub-(?P<version>[^-]+)-py3-none-any\.whl$")
_CONTEXT_SKIP = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache"})
_MTIME_FLOOR = 315532800  # 1980-01-01, as in the kernel image's context


class GatewayImage(BaseModel):
    """A gateway image that was built and checked."""

    model_config = ConfigDict(frozen=True)

    name: str
    id: str
    kernelhub_version: str
    python_version: str
    size_bytes: int


def gateway_tag(version: str = kernelhub.__version__) -> str:
    """``kernelhub/gateway:<version>``, the name compose.yaml uses."""
    return f"{GATEWAY_REPOSITORY}:{version}"


def gateway_labels(version: str) -> dict[str, str]:
    """The labels the gateway image carries (the Dockerfile repeats role and managed so
    that every layer of its final stage has them)."""
    return {LABEL_ROLE: "gateway", LABEL_MANAGED: "true", LABEL_VERSION: version}


def _discard(_line: str) -> None:
    pass


# ---------------------------------------------------------------------------- sources


def find_source_checkout(candidates: Sequence[Path] | None = None) -> Path:
    """The kernelhub source checkout to build from: the first candidate with a
    ``pyproject.toml`` for the project ``kernelhub`` and a ``gateway-image/Dockerfile``.

    ``candidates`` defaults to the directory above the imported package (an editable
    install or a clone on ``PYTHONPATH``). Raises :class:`ImageBuildError` naming where it
    looked and what to pass instead.
    """
    if candidates is None:
        candidates = [Path(kernelhub.__file__).resolve().parent.parent]
    for candidate in candidates:
        try:
            project = tomllib.loads((candidate / "pyproject.toml").read_text())
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if project.get("project", {}).get("name") != "kernelhub":
            continue
        if (candidate / GATEWAY_IMAGE_DIR / "Dockerfile").is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates) or "nowhere"
    raise ImageBuildError(
        "building the gateway image needs a kernelhub source checkout (pyproject.toml and "
        f"{GATEWAY_IMAGE_DIR}/Dockerfile), because kernelhub's own wheel is built from it; "
        f"looked in {looked}. Run it from a clone installed with `pip install -e .`, or "
        "pass the checkout's path as source"
    )


# ---------------------------------------------------------------------------- kernelhub wheel


def pip_wheel_command(source: Path, dest: Path, *, python: str = sys.executable) -> list[str]:
    """The ``pip wheel`` command line building kernelhub's own wheel (no dependencies)."""
    return [
        python,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--wheel-dir",
        str(dest),
        "--progress-bar",
        "off",
        "--no-input",
        "--disable-pip-version-check",
        str(source),
    ]


def kernelhub_wheel(names: Iterable[str]) -> tuple[str, str]:
    """Pick kernelhub's wheel among the file names ``pip wheel`` left; return
    ``(file name, version)``. Exactly one ``kernelhub-<version>-py3-none-any.whl`` must be
    there, or :class:`ImageBuildError` says what was found."""
    found = sorted(
        (name, match["version"]) for name in names if (match := _WHEEL_NAME.match(name)) is not None
    )
    if len(found) != 1:
        seen = ", ".join(sorted(names)) or "no files"
        raise ImageBuildError(
            f"expected one kernelhub-<version>-py3-none-any.whl from pip wheel, found {seen}"
        )
    return found[0]


def build_kernelhub_wheel(
    source: Path, dest: Path, progress: Callable[[str], None], *, python: str = sys.executable
) -> tuple[Path, str]:
    """Build kernelhub's wheel from ``source`` into the empty directory ``dest``; return
    its path and version. pip fetches the build backend from your index (pip config
    applies); raises :class:`ImageBuildError` with pip's output tail."""
    argv = pip_wheel_command(source, dest, python=python)
    progress("$ " + " ".join(argv))
    started = time.monotonic()
    status, tail = run_streaming(argv, progress)
    if status != 0:
        raise ImageBuildError(
            f"pip wheel of kernelhub from {source} failed (exit status {status}); pip needs "
            "to reach your package index for the build backend (hatchling)" + format_tail(tail)
        )
    name, version = kernelhub_wheel(p.name for p in dest.iterdir())
    progress(f"built {name} in {time.monotonic() - started:.1f} s")
    return dest / name, version


# ---------------------------------------------------------------------------- context


def _normalize(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Root-owned members with 0644/0755 modes and no caches, independent of the host."""
    if any(part in _CONTEXT_SKIP for part in Path(info.name).parts):
        return None
    if info.name.endswith((".pyc", ".pyo")):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o755 if info.isdir() or info.mode & 0o111 else 0o644
    info.mtime = max(int(info.mtime), _MTIME_FLOOR)
    return info


def write_gateway_context(
    fileobj: IO[bytes], sources: Path, wheels: Iterable[Path], own_wheel: Path
) -> None:
    """Write the docker build context as an uncompressed tar to ``fileobj``: ``Dockerfile``
    and ``requirements.txt`` from ``sources`` (the ``gateway-image`` directory), the locked
    dependencies' wheels under ``wheels/`` and kernelhub's own wheel under ``dist/`` (its
    own layer, so an edit of kernelhub does not reinstall the dependencies)."""
    with tarfile.open(fileobj=fileobj, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("Dockerfile", "requirements.txt"):
            path = sources / name
            if not path.is_file():
                raise ImageBuildError(f"the gateway image source {path} is missing")
            tar.add(path, arcname=name, filter=_normalize)
        for directory, members in (("wheels", list(wheels)), ("dist", [own_wheel])):
            info = tarfile.TarInfo(directory)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            info.mtime = _MTIME_FLOOR
            tar.addfile(info)
            for wheel in members:
                tar.add(wheel, arcname=f"{directory}/{wheel.name}", filter=_normalize)


# ---------------------------------------------------------------------------- build


def build_gateway_image(
    settings: Settings | None = None,
    *,
    tag: str | None = None,
    base: BaseChoice | str = "auto",
    mirror: str = DEBIAN_MIRROR,
    progress: Callable[[str], None] = _discard,
    client: docker.DockerClient | None = None,
    nocache: bool = False,
    source: Path | None = None,
) -> GatewayImage:
    """Build the gateway image and return its checked :class:`GatewayImage`.

    ``tag`` defaults to :func:`gateway_tag` of the version built from ``source`` (default:
    :func:`find_source_checkout`). ``base`` is chosen as for the kernel image (see
    :func:`kernelhub.image.build.build_image`; ``auto`` never contacts a registry). Wheels
    are cached under ``settings.data_dir / "wheels"``. Raises :class:`ImageBuildError`, or
    :class:`BackendUnavailableError` when no Docker daemon answers.
    """
    if settings is None:
        settings = load_settings()
    started = time.monotonic()
    source = find_source_checkout([source] if source is not None else None)
    sources = source / GATEWAY_IMAGE_DIR
    own_client = client is None
    if client is None:
        client = docker_client(settings)
    try:
        progress(f"==> [1/5] base image ({base})")
        base_image = resolve_base(client, base, mirror=mirror, progress=progress)
        target = probe_platform(client, base_image)
        progress(
            f"base {base_image}: CPython {target.python_version} on {target.machine}, "
            f"glibc {target.glibc[0]}.{target.glibc[1]}"
        )

        progress("==> [2/5] server wheels (pip download on the host)")
        wheels = download_wheels(
            sources / "requirements.txt", settings.data_dir / "wheels", target, progress
        )

        with tempfile.TemporaryDirectory(prefix="kernelhub-wheel-") as scratch:
            progress(f"==> [3/5] kernelhub wheel from {source}")
            own_wheel, version = build_kernelhub_wheel(source, Path(scratch), progress)
            tag = tag or gateway_tag(version)

            progress(f"==> [4/5] docker build {tag} (network disabled)")
            previous_id = _current_id(client, tag)
            step_started = time.monotonic()
            with tempfile.TemporaryFile() as context:
                write_gateway_context(context, sources, wheels, own_wheel)
                context.seek(0)
                image_id = _docker_build(
                    client,
                    context,
                    tag=tag,
                    buildargs={"BASE": base_image, "KERNELHUB_VERSION": version},
                    labels=gateway_labels(version),
                    nocache=nocache,
                    progress=progress,
                )
            progress(f"docker build finished in {time.monotonic() - step_started:.1f} s")

        progress(f"==> [5/5] checking {tag}")
        info = check_gateway_image(client, tag, version=version)
        return _settle_build(client, tag, info, image_id, previous_id, started, progress)
    finally:
        if own_client:
            client.close()


def check_gateway_image(client: docker.DockerClient, tag: str, *, version: str) -> GatewayImage:
    """The image ``tag`` carries the gateway labels for ``version``, and its server stack
    imports when run once with no network and a read-only root; else :class:`ImageBuildError`.
    Called by :func:`build_gateway_image` after the docker build."""
    with docker_errors(f"inspecting gateway image {tag}"):
        try:
            image = client.images.get(tag)
        except docker.errors.ImageNotFound as exc:
            raise ImageBuildError(f"gateway image {tag} not found after building it") from exc
    labels = image.labels or {}
    wanted = gateway_labels(version)
    wrong = {k: labels.get(k) for k, v in wanted.items() if labels.get(k) != v}
    if wrong:
        raise ImageBuildError(
            f"gateway image {tag} has labels {wrong}, expected {wanted}; rebuild it with "
            "`kernelhub image build-gateway`"
        )
    with docker_errors(f"running gateway image {tag} once", error=ImageBuildError):
        output = client.containers.run(
            tag,
            entrypoint=[f"{GATEWAY_VENV}/bin/python", "-c", SMOKE_SCRIPT],
            command=[],
            network_mode="none",
            read_only=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            labels={LABEL_MANAGED: "true", LABEL_ROLE: "image-probe"},
            remove=True,
            stdout=True,
            stderr=True,
        )
    text = output.decode(errors="replace") if isinstance(output, bytes) else str(output)
    last = (text.strip().splitlines() or [""])[-1].split()
    if len(last) != 2 or last[0] != version:
        raise ImageBuildError(
            f"gateway image {tag} does not report kernelhub {version} when run"
            + format_tail(text.splitlines()[-20:])
        )
    attrs: dict[str, Any] = image.attrs or {}
    return GatewayImage(
        name=tag,
        id=str(image.id),
        kernelhub_version=version,
        python_version=last[1],
        size_bytes=int(attrs.get("Size") or 0),
    )


__all__ = [
    "GATEWAY_IMAGE_DIR",
    "GATEWAY_REPOSITORY",
    "GATEWAY_VENV",
    "GatewayImage",
    "build_gateway_image",
    "build_kernelhub_wheel",
    "check_gateway_image",
    "find_source_checkout",
    "gateway_labels",
    "gateway_tag",
    "kernelhub_wheel",
    "pip_wheel_command",
    "write_gateway_context",
]
