"""Building the kernel image (``kernelhub image build``) and checking it before use.

Two entry points:

- :func:`build_image` — called by the CLI. Base image -> wheels on the host -> docker build
  with the network disabled -> :func:`check_image`. Every step is announced through
  ``progress`` and pip, debootstrap and docker build output is streamed through it line by
  line. Never contacts a container registry unless ``base="python-slim"`` is asked for.
- :func:`check_image` — called by the docker backend when it starts: the configured image
  exists and speaks our kernel protocol, or :class:`ImageError` says how to fix it.

Both raise only :mod:`kernelhub.errors` types; docker SDK errors are translated by
:func:`kernelhub.image.docker_errors.docker_errors`.
"""

from __future__ import annotations

import io
import re
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any, Literal, Protocol, TypeVar

import docker
import docker.errors
from pydantic import BaseModel, ConfigDict

import kernelhub
from kernelhub import KERNEL_PROTOCOL_VERSION, __version__
from kernelhub.config import Settings, load_settings
from kernelhub.errors import ImageBuildError, ImageError
from kernelhub.image import (
    DEBIAN_MIRROR,
    LABEL_MANAGED,
    LABEL_PROTOCOL,
    LABEL_PYTHON,
    LABEL_ROLE,
    LABEL_VERSION,
)
from kernelhub.image.base import build_debootstrap_base, find_base_image, probe_platform
from kernelhub.image.docker_errors import docker_errors
from kernelhub.image.process import TAIL_LINES, format_tail
from kernelhub.image.wheels import download_wheelhouse, download_wheels, locked_requirements

BaseChoice = Literal["auto", "debootstrap", "python-slim"]
#: Image profiles: the slim lock (``requirements.txt``) and what each profile adds to it.
PROFILES: dict[str, str | None] = {
    "slim": None,
    "data-science": "requirements-data-science.txt",
}
LABEL_PROFILE = "org.kernelhub.profile"
#: The registry image ``base="python-slim"`` builds on (only when asked for explicitly).
PYTHON_SLIM = "python:3.11-slim"
_BUILD_CONTEXT_SKIP = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache"})
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # the builder colours stderr red
_MTIME_FLOOR = 315532800  # 1980-01-01: keeps zip-based tools happy with copied files


class ImageInfo(BaseModel):
    """A kernel image kernelhub has checked and will use."""

    model_config = ConfigDict(frozen=True)

    name: str
    id: str
    protocol: str
    kernelhub_version: str | None = None
    python_version: str | None = None
    size_bytes: int


def _discard(_line: str) -> None:
    pass


# ---------------------------------------------------------------------------- check


def image_info(
    name: str, image_id: str, labels: Mapping[str, str] | None, size_bytes: int
) -> ImageInfo:
    """Decide whether an image with these labels is usable as the kernel image.

    Raises :class:`ImageError` naming the image, what was found, what is needed and how to
    rebuild, when the protocol label is missing or differs from ``KERNEL_PROTOCOL_VERSION``.
    """
    labels = labels or {}
    protocol = labels.get(LABEL_PROTOCOL)
    if protocol is None:
        raise ImageError(
            f"image {name} is not a kernelhub kernel image (it has no {LABEL_PROTOCOL} "
            "label); build one with `kernelhub image build`, or point "
            "KERNELHUB_DOCKER__IMAGE at one"
        )
    if protocol != KERNEL_PROTOCOL_VERSION:
        built_by = labels.get(LABEL_VERSION, "an unknown version")
        raise ImageError(
            f"kernel image {name} was built for kernel protocol {protocol!r} (by kernelhub "
            f"{built_by}) but kernelhub {__version__} needs protocol "
            f"{KERNEL_PROTOCOL_VERSION!r}; rebuild it with `kernelhub image build`"
        )
    return ImageInfo(
        name=name,
        id=image_id,
        protocol=protocol,
        kernelhub_version=labels.get(LABEL_VERSION),
        python_version=labels.get(LABEL_PYTHON),
        size_bytes=size_bytes,
    )


def check_image(client: docker.DockerClient, image_name: str) -> ImageInfo:
    """Look up ``image_name`` locally (never pulls) and check it is a kernel image for our
    protocol. Called by the docker backend at start; raises :class:`ImageError`."""
    with docker_errors(f"inspecting kernel image {image_name}", error=ImageError):
        try:
            image = client.images.get(image_name)
        except docker.errors.ImageNotFound as exc:
            raise ImageError(
                f"kernel image {image_name} not found; build it with `kernelhub image build`"
            ) from exc
    attrs: dict[str, Any] = image.attrs or {}
    return image_info(image_name, str(image.id), image.labels, int(attrs.get("Size") or 0))


# ---------------------------------------------------------------------------- build


def kernel_image_dir() -> Path:
    """The ``kernel-image`` directory: packaged in the wheel as ``kernelhub/_kernel_image``,
    or ``<repo>/kernel-image`` in a source checkout."""
    package = Path(kernelhub.__file__).resolve().parent
    candidates = (package / "_kernel_image", package.parent / "kernel-image")
    for candidate in candidates:
        if (candidate / "Dockerfile").is_file():
            return candidate
    raise ImageError(
        "cannot find the kernel image sources (Dockerfile, requirements.txt, "
        f"kernelhub_kernel/); looked in {', '.join(str(c) for c in candidates)}. "
        "Reinstall kernelhub"
    )


def build_image(
    settings: Settings | None = None,
    *,
    tag: str | None = None,
    base: BaseChoice | str = "auto",
    mirror: str = DEBIAN_MIRROR,
    progress: Callable[[str], None] = _discard,
    client: docker.DockerClient | None = None,
    nocache: bool = False,
    sources: Path | None = None,
    profile: str = "slim",
    requirements: Path | None = None,
    wheelhouse: Path | None = None,
) -> ImageInfo:
    """Build the kernel image and return its checked :class:`ImageInfo`.

    ``tag`` defaults to ``settings.docker.image``. ``base``:
      ``auto``         the local debootstrapped base (:data:`~kernelhub.image.BASE_IMAGE`),
                       made with debootstrap first if there is none; never contacts a
                       container registry;
      ``debootstrap``  (re)make that base with debootstrap from ``mirror``, then build;
      ``python-slim``  ``python:3.11-slim``, pulled from its registry if not local;
      anything else    an image name that must already exist locally (never pulled).

    Wheels are downloaded on the host into ``settings.data_dir / "wheels"``, cached per
    lock and platform, so rebuilds are offline. ``client`` defaults to one made from
    ``settings.docker``; ``sources`` (Dockerfile, requirements.txt, kernelhub_kernel/) to
    :func:`kernel_image_dir`. The CLI passes its ``settings``; without them they are
    loaded from the environment here. ``profile``: ``slim`` (numpy, pandas, matplotlib)
    or ``data-science`` (adds ``requirements-data-science.txt``: scipy, scikit-learn,
    statsmodels, polars, duckdb, pyarrow ...); ``requirements``: the operator's own lock
    of further pins, added to either; ``wheelhouse``: a requirements file whose wheels
    (with dependencies) seed the image's wheelhouse for ``pip install`` in a cell.
    Raises :class:`ImageBuildError`, or :class:`BackendUnavailableError` when no Docker
    daemon answers.
    """
    if settings is None:
        settings = load_settings()
    tag = tag or settings.docker.image
    started = time.monotonic()
    own_client = client is None
    if client is None:
        client = docker_client(settings)
    try:
        sources = sources or kernel_image_dir()

        progress(f"==> [1/4] base image ({base})")
        base_image = resolve_base(client, base, mirror=mirror, progress=progress)
        target = probe_platform(client, base_image)
        progress(
            f"base {base_image}: CPython {target.python_version} on {target.machine}, "
            f"glibc {target.glibc[0]}.{target.glibc[1]}"
        )

        progress("==> [2/4] wheels (pip download on the host)")
        lock = profile_lock(sources, profile, requirements)
        with tempfile.TemporaryDirectory(prefix="kernelhub-lock-") as tmp:
            lock_file = Path(tmp) / "requirements.txt"
            lock_file.write_text(lock)
            wheels = download_wheels(lock_file, settings.data_dir / "wheels", target, progress)
        seeded: list[Path] = []
        if wheelhouse is not None:
            seeded = download_wheelhouse(
                wheelhouse, settings.data_dir / "wheelhouse", target, progress
            )

        progress(f"==> [3/4] docker build {tag} (network disabled)")
        previous_id = _current_id(client, tag)
        step_started = time.monotonic()
        with tempfile.TemporaryFile() as context:
            write_context(context, sources, wheels, seeded, requirements=lock)
            context.seek(0)
            image_id = _docker_build(
                client,
                context,
                tag=tag,
                buildargs={
                    "BASE": base_image,
                    "KERNELHUB_PROTOCOL": KERNEL_PROTOCOL_VERSION,
                    "KERNELHUB_VERSION": __version__,
                },
                labels={
                    LABEL_PROTOCOL: KERNEL_PROTOCOL_VERSION,
                    LABEL_VERSION: __version__,
                    LABEL_MANAGED: "true",
                    LABEL_PYTHON: target.python_version,
                    LABEL_ROLE: "kernel",
                    LABEL_PROFILE: profile,
                },
                nocache=nocache,
                progress=progress,
            )
        progress(f"docker build finished in {time.monotonic() - step_started:.1f} s")

        progress(f"==> [4/4] checking {tag}")
        info = check_image(client, tag)
        return _settle_build(client, tag, info, image_id, previous_id, started, progress)
    finally:
        if own_client:
            client.close()


def profile_lock(sources: Path, profile: str, extra: Path | None = None) -> str:
    """The image's full lock: the slim one, the profile's additions, the operator's."""
    if profile not in PROFILES:
        raise ImageBuildError(
            f"unknown image profile {profile!r}; choose one of {', '.join(PROFILES)}"
        )
    parts = [(sources / "requirements.txt").read_text()]
    added = PROFILES[profile]
    if added is not None:
        parts.append((sources / added).read_text())
    if extra is not None:
        try:
            parts.append(extra.read_text())
        except OSError as exc:
            raise ImageBuildError(f"cannot read the requirements file {extra}: {exc}") from exc
    names: dict[str, str] = {}
    for line in locked_requirements("\n".join(parts)):
        name = line.split("==", 1)[0]
        if "==" not in line:
            raise ImageBuildError(
                f"{line!r} is not pinned; every requirement of the image is name==version "
                "(a lock, so the offline build resolves nothing)"
            )
        if name in names and names[name] != line:
            raise ImageBuildError(f"{names[name]!r} and {line!r} pin the same package twice")
        names[name] = line
    return "".join(f"{line}\n" for line in sorted(names.values()))


def _current_id(client: docker.DockerClient, tag: str) -> str | None:
    with docker_errors(f"looking up {tag}"):
        try:
            return str(client.images.get(tag).id)
        except docker.errors.ImageNotFound:
            return None


def image_exists(client: docker.DockerClient, name: str) -> bool:
    """Is there a local image by this name (whatever it is)?"""
    return _current_id(client, name) is not None


class _Built(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def size_bytes(self) -> int: ...


_B = TypeVar("_B", bound=_Built)


def _settle_build(
    client: docker.DockerClient,
    tag: str,
    info: _B,
    image_id: str,
    previous_id: str | None,
    started: float,
    progress: Callable[[str], None],
) -> _B:
    """The last step of every image build: the tag must point at what this build made
    (refuse a race with another build), the image it replaced goes, and say so."""
    if info.id != image_id:
        raise ImageBuildError(
            f"docker build produced {image_id} but {tag} is {info.id}; "
            "another build may have run at the same time, retry"
        )
    if previous_id is not None and previous_id != info.id:
        _remove_replaced(client, previous_id, progress)
    progress(
        f"built {tag} ({info.id[:19]}, {info.size_bytes / 2**20:.1f} MiB) "
        f"in {time.monotonic() - started:.1f} s"
    )
    return info


def _remove_replaced(
    client: docker.DockerClient, image_id: str, progress: Callable[[str], None]
) -> None:
    """Remove the image the new build replaced under its tag, unless it still has another
    tag or a container (even a stopped one) uses it: then Docker refuses and it stays."""
    try:
        if client.images.get(image_id).tags:
            return
        client.images.remove(image_id)
        progress(f"removed the replaced image {image_id[:19]}")
    except docker.errors.APIError as exc:
        progress(f"kept the replaced image {image_id[:19]}: {exc.explanation or exc}")


def docker_client(settings: Settings) -> docker.DockerClient:
    """A client for the daemon ``settings.docker`` names; no answer: BackendUnavailableError."""
    with docker_errors("connecting to the Docker daemon"):
        if settings.docker.base_url:
            return docker.DockerClient(base_url=settings.docker.base_url)
        return docker.from_env()


def resolve_base(
    client: docker.DockerClient, base: str, *, mirror: str, progress: Callable[[str], None]
) -> str:
    """The local image to build on for the ``base`` choice (see :func:`build_image`),
    making the debootstrapped base if needed. Only ``python-slim`` may pull."""
    if base == "auto":
        found = find_base_image(client)
        if found is not None:
            progress(f"using the local base image {found}")
            return found
        progress("no local kernelhub base image; making one with debootstrap")
        return build_debootstrap_base(client, mirror=mirror, progress=progress)
    if base == "debootstrap":
        return build_debootstrap_base(client, mirror=mirror, progress=progress)
    name = PYTHON_SLIM if base == "python-slim" else base
    with docker_errors(f"looking up base image {name}"):
        try:
            client.images.get(name)
            progress(f"using the local base image {name}")
            return name
        except docker.errors.ImageNotFound:
            if base != "python-slim":
                raise ImageBuildError(
                    f"base image {name} is not present locally; kernelhub never pulls an "
                    f"arbitrary base. Run `docker pull {name}` first, or use "
                    "--base auto (a debootstrapped Debian, no registry needed)"
                ) from None
        progress(f"pulling {name} from its registry (asked for with base=python-slim)")
        repository, _, tag = name.partition(":")
        client.images.pull(repository, tag=tag or "latest")
        return name


def write_context(
    fileobj: IO[bytes],
    sources: Path,
    wheels: Iterable[Path],
    wheelhouse: Iterable[Path] = (),
    requirements: str | None = None,
) -> None:
    """Write the docker build context as an uncompressed tar to ``fileobj``.

    It holds ``Dockerfile``, ``requirements.txt`` (``requirements`` if given: a profile's
    lock), ``wheels/*.whl``, ``wheelhouse/*.whl`` (the operator's pre-seeded wheelhouse;
    an empty directory by default) and ``kernelhub_kernel/`` (caches left out). Members are owned by root with modes
    normalized to 0644/0755, so the image does not depend on the host checkout's
    ownership or umask.
    """

    def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if any(part in _BUILD_CONTEXT_SKIP for part in Path(info.name).parts):
            return None
        if info.name.endswith((".pyc", ".pyo")):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = 0o755 if info.isdir() or info.mode & 0o111 else 0o644
        info.mtime = max(int(info.mtime), _MTIME_FLOOR)
        return info

    with tarfile.open(fileobj=fileobj, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(sources / "Dockerfile", arcname="Dockerfile", filter=normalize)
        if requirements is None:
            tar.add(sources / "requirements.txt", arcname="requirements.txt", filter=normalize)
        else:
            _add_bytes(tar, "requirements.txt", requirements.encode())
        package = sources / "kernelhub_kernel"
        if not package.is_dir():
            raise ImageBuildError(f"the in-kernel package {package} is missing")
        tar.add(package, arcname="kernelhub_kernel", recursive=True, filter=normalize)
        for folder, members in (("wheels", wheels), ("wheelhouse", wheelhouse)):
            directory = tarfile.TarInfo(folder)
            directory.type = tarfile.DIRTYPE
            directory.mode = 0o755
            directory.mtime = _MTIME_FLOOR
            tar.addfile(directory)
            for wheel in members:
                tar.add(wheel, arcname=f"{folder}/{wheel.name}", filter=normalize)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = _MTIME_FLOOR
    tar.addfile(info, io.BytesIO(data))


class BuildLog:
    """Follows a classic ``docker build`` JSON stream: whole output lines (colour codes
    removed), the current step, the output tail since that step began, the built image
    id, and any error.

    Pure (feed it the decoded chunks); :func:`_docker_build` drives it.
    """

    def __init__(self) -> None:
        self.step = "the start"
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.image_id: str | None = None
        self.error: str | None = None
        self._partial = ""

    def feed(self, chunk: Mapping[str, Any]) -> list[str]:
        """Take one decoded chunk; return the complete lines it finished, for display."""
        lines: list[str] = []
        if "stream" in chunk:
            text = self._partial + _ANSI_ESCAPE.sub("", str(chunk["stream"]))
            *complete, self._partial = text.split("\n")
            lines.extend(line.rstrip("\r") for line in complete)
        if isinstance(chunk.get("aux"), Mapping) and "ID" in chunk["aux"]:
            self.image_id = str(chunk["aux"]["ID"])
        if chunk.get("error") or chunk.get("errorDetail"):
            detail = chunk.get("errorDetail") or {}
            message = chunk.get("error") or (
                detail.get("message") if isinstance(detail, Mapping) else None
            )
            self.error = str(message or detail).strip()
            lines.append(f"ERROR: {self.error}")
        elif "status" in chunk:  # e.g. a base image being pulled (python-slim only)
            lines.append(str(chunk["status"]))
        for line in lines:
            if line.startswith("Step ") and " : " in line:
                self.step = line
                self.tail.clear()
            else:
                self.tail.append(line)
        return lines

    def finish(self) -> list[str]:
        """Flush a last line that had no newline."""
        if not self._partial:
            return []
        line, self._partial = self._partial, ""
        self.tail.append(line)
        return [line]


def _docker_build(
    client: docker.DockerClient,
    context: IO[bytes],
    *,
    tag: str,
    buildargs: dict[str, str],
    labels: dict[str, str],
    nocache: bool,
    progress: Callable[[str], None],
) -> str:
    log = BuildLog()
    with docker_errors(f"docker build of {tag}"):
        chunks = client.api.build(
            fileobj=context,
            custom_context=True,
            tag=tag,
            buildargs=buildargs,
            labels=labels,
            network_mode="none",
            pull=False,
            rm=True,
            forcerm=True,
            nocache=nocache,
            decode=True,
            use_config_proxy=False,
        )
        for chunk in chunks:
            for line in log.feed(chunk):
                progress(line)
        for line in log.finish():
            progress(line)
    if log.error is not None:
        raise ImageBuildError(
            f"docker build of {tag} failed at {log.step}: {log.error}" + format_tail(log.tail)
        )
    if log.image_id is None:
        raise ImageBuildError(
            f"docker build of {tag} ended without reporting an image id" + format_tail(log.tail)
        )
    return log.image_id


__all__ = [
    "PYTHON_SLIM",
    "BaseChoice",
    "BuildLog",
    "ImageInfo",
    "build_image",
    "check_image",
    "docker_client",
    "image_exists",
    "image_info",
    "kernel_image_dir",
    "resolve_base",
    "write_context",
]
