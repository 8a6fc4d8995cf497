"""Downloading the image's pinned wheels on the host, for the base image's platform.

The docker build has no network, so every wheel in ``kernel-image/requirements.txt`` is
fetched here first with ``pip download``, for the Python, ABI, CPU architecture and glibc
the base image reports (:class:`TargetPlatform`), not the host's. The wheels are cached
under a key derived from the pinned requirements and that platform, so a rebuild with the
same lock is offline.

The pure parts (:func:`platform_tags`, :func:`pip_download_command`, :func:`cache_key`)
are what the unit tests cover; :func:`download_wheels` runs pip.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kernelhub.errors import ImageBuildError
from kernelhub.image.process import format_tail, run_streaming

#: manylinux_2_17 is the oldest tag shipped for every architecture we build for.
MIN_GLIBC = (2, 17)
#: Architectures that have a legacy ``manylinux2014_<arch>`` tag (PEP 599).
_MANYLINUX2014_ARCHES = frozenset(
    {"x86_64", "i686", "aarch64", "armv7l", "ppc64", "ppc64le", "s390x"}
)
_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}
MANIFEST = "manifest.txt"


@dataclass(frozen=True)
class TargetPlatform:
    """What the wheels must fit: the base image's CPython, CPU and C library."""

    python: tuple[int, int]
    machine: str
    glibc: tuple[int, int]

    @property
    def python_version(self) -> str:
        return f"{self.python[0]}.{self.python[1]}"

    @property
    def abi(self) -> str:
        return f"cp{self.python[0]}{self.python[1]}"


def normalize_machine(machine: str) -> str:
    """``uname -m`` spelling of an architecture (``arm64`` -> ``aarch64``)."""
    lowered = machine.strip().lower()
    return _MACHINE_ALIASES.get(lowered, lowered)


def platform_tags(target: TargetPlatform) -> list[str]:
    """The ``--platform`` values for ``pip download``, most specific first.

    ``manylinux_2_<N>_<arch>`` for N from the target's glibc down to 17, then the legacy
    ``manylinux2014_<arch>`` (pip itself widens that one to manylinux2010 and manylinux1).
    Pure-Python ``none-any`` wheels match without a platform of their own.
    """
    major, minor = target.glibc
    if (major, minor) < MIN_GLIBC or major != MIN_GLIBC[0]:
        raise ImageBuildError(
            f"the base image has glibc {major}.{minor}; the kernel's wheels need glibc "
            f"{MIN_GLIBC[0]}.{MIN_GLIBC[1]} or newer (a Debian bookworm base has 2.36)"
        )
    arch = target.machine
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, MIN_GLIBC[1] - 1, -1)]
    if arch in _MANYLINUX2014_ARCHES:
        tags.append(f"manylinux2014_{arch}")
    return tags


def pip_download_command(
    requirements: Path,
    dest: Path,
    target: TargetPlatform,
    *,
    python: str = sys.executable,
    deps: bool = False,
) -> list[str]:
    """The ``pip download`` command line fetching exactly the locked wheels for ``target``
    (``deps``: and their dependencies, for a wheelhouse seeded from a loose list)."""
    argv = [
        python,
        "-m",
        "pip",
        "download",
        "--requirement",
        str(requirements),
        "--dest",
        str(dest),
        "--only-binary=:all:",
        *([] if deps else ["--no-deps"]),
        "--implementation",
        "cp",
        "--python-version",
        target.python_version,
        "--abi",
        target.abi,
    ]
    for tag in platform_tags(target):
        argv += ["--platform", tag]
    argv += ["--progress-bar", "off", "--no-input", "--disable-pip-version-check"]
    return argv


def locked_requirements(text: str) -> list[str]:
    """The requirement lines of a lock file, comments and blanks dropped, sorted, lowercase."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return sorted(line.lower().replace("_", "-") for line in lines if line)


def cache_key(requirements_text: str, target: TargetPlatform) -> str:
    """The wheel cache directory name: readable platform prefix plus a content hash.

    It changes when a pin or the target platform changes, and not when only comments,
    ordering or blank lines of the requirements file do.
    """
    material = "\n".join(
        [
            *locked_requirements(requirements_text),
            f"python={target.python_version}",
            f"machine={target.machine}",
            f"glibc={target.glibc[0]}.{target.glibc[1]}",
        ]
    )
    digest = hashlib.sha256(material.encode()).hexdigest()[:16]
    return f"{target.abi}-{target.machine}-glibc{target.glibc[0]}.{target.glibc[1]}-{digest}"


def cached_wheels(directory: Path) -> list[Path] | None:
    """The wheels of a complete cache entry, or ``None`` if it is missing or incomplete."""
    try:
        names = (directory / MANIFEST).read_text().split()
    except OSError:
        return None
    wheels = [directory / name for name in names]
    return wheels if wheels and all(w.is_file() for w in wheels) else None


def download_wheels(
    requirements: Path,
    cache_root: Path,
    target: TargetPlatform,
    progress: Callable[[str], None],
    *,
    python: str = sys.executable,
) -> list[Path]:
    """Return the locked wheels for ``target``, downloading them unless already cached.

    The download goes to a private ``.partial`` directory that is renamed into place only
    after pip succeeded and a manifest was written, so an interrupted download is never
    mistaken for a cached one. Raises :class:`ImageBuildError` with pip's output tail.
    """
    text = requirements.read_text()
    expected = len(locked_requirements(text))
    directory = cache_root / cache_key(text, target)
    cached = cached_wheels(directory)
    if cached is not None and len(cached) == expected:
        progress(f"using {len(cached)} cached wheels from {directory}")
        return cached

    cache_root.mkdir(parents=True, exist_ok=True)
    partial = cache_root / f".{directory.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        argv = pip_download_command(requirements, partial, target, python=python)
        progress("$ " + " ".join(argv))
        started = time.monotonic()
        status, tail = run_streaming(argv, progress)
        if status != 0:
            raise ImageBuildError(
                f"pip download of the kernel image's wheels failed (exit status {status}) "
                f"for CPython {target.python_version} on {target.machine}; pip needs to reach "
                "your package index (pip config applies)" + format_tail(tail)
            )
        names = sorted(p.name for p in partial.glob("*.whl"))
        if len(names) != expected:
            raise ImageBuildError(
                f"pip download produced {len(names)} wheels for {expected} pinned "
                f"requirements in {requirements}; each pin must resolve to exactly one wheel"
                + format_tail(tail)
            )
        (partial / MANIFEST).write_text("\n".join(names) + "\n")
        if directory.exists():  # a stale, incomplete entry (or a concurrent build's)
            shutil.rmtree(directory, ignore_errors=True)
        try:
            partial.rename(directory)
        except OSError:
            if cached_wheels(directory) is None:
                raise
        progress(
            f"downloaded {len(names)} wheels in {time.monotonic() - started:.1f} s to {directory}"
        )
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    wheels = cached_wheels(directory)
    if wheels is None:  # pragma: no cover - the rename above just produced it
        raise ImageBuildError(f"wheel cache {directory} is incomplete; delete it and retry")
    return wheels


def download_wheelhouse(
    requirements: Path,
    dest: Path,
    target: TargetPlatform,
    progress: Callable[[str], None],
    *,
    python: str = sys.executable,
) -> list[Path]:
    """The wheels of ``requirements`` and their dependencies for ``target``, into
    ``dest`` (kept between builds: pip skips what is there). They seed the image's
    wheelhouse, so ``pip install`` in a cell finds them with no network at all."""
    dest.mkdir(parents=True, exist_ok=True)
    argv = pip_download_command(requirements, dest, target, python=python, deps=True)
    progress("$ " + " ".join(argv))
    status, tail = run_streaming(argv, progress)
    if status != 0:
        raise ImageBuildError(
            f"pip download of the wheelhouse requirements {requirements} failed (exit status "
            f"{status}); pip needs to reach your package index" + format_tail(tail)
        )
    return sorted(dest.glob("*.whl"))
