"""The base image the kernel image is built on.

By default that is a Debian bookworm root file system made here with ``debootstrap`` and
turned into a local image with ``docker import`` (tag :data:`BASE_IMAGE`, labels
``org.kernelhub.base=bookworm`` and ``org.kernelhub.role=base``), so building the kernel
image never contacts a container registry. Callers (:func:`kernelhub.image.build.build_image`):

- :func:`find_base_image` — the local debootstrapped base, or ``None``;
- :func:`build_debootstrap_base` — debootstrap, trim, import; returns the image id;
- :func:`probe_platform` — run a base once (no network) to learn its Python and glibc.

:func:`trim_rootfs`, :func:`debootstrap_command`, :func:`import_changes` and
:func:`parse_probe` are pure or touch only the directory given, and are unit-tested.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import docker
import docker.errors

from kernelhub import __version__
from kernelhub.errors import ImageBuildError
from kernelhub.image import (
    BASE_IMAGE,
    BASE_SUITE,
    LABEL_BASE,
    LABEL_MANAGED,
    LABEL_ROLE,
    LABEL_VERSION,
)
from kernelhub.image.docker_errors import docker_errors
from kernelhub.image.process import format_tail, run_streaming
from kernelhub.image.wheels import TargetPlatform, normalize_machine

#: Packages on top of ``--variant=minbase`` (which is dpkg, apt, coreutils, bash, ...).
DEBOOTSTRAP_PACKAGES = ("python3", "python3-venv", "ca-certificates")
_STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CHUNK_BYTES = 1 << 20

# Run inside a base image to learn what wheels fit it. Prints one JSON object.
PROBE_SCRIPT = """\
import json, os, platform, sys
try:
    libc = os.confstr("CS_GNU_LIBC_VERSION")
except (ValueError, OSError):
    libc = None
print(json.dumps({
    "implementation": sys.implementation.name,
    "python": list(sys.version_info[:2]),
    "machine": platform.machine(),
    "libc": libc,
}))
"""

# What trim_rootfs removes. Paths are relative to the root file system.
_PURGE_DIRS = (  # everything inside goes
    "usr/share/man",
    "usr/share/info",
    "usr/share/lintian",
    "usr/share/linda",
    "usr/share/bug",
    "var/cache/apt",
    "var/cache/debconf/templates.dat-old",
    "tmp",
    "var/tmp",
)
_CLEAR_FILE_DIRS = ("var/lib/apt/lists", "var/log")  # files go, directories stay
_OLD_FILE_DIRS = ("var/cache/debconf", "var/lib/dpkg")  # "*-old" backups go
_HOST_LEAKS = {  # debootstrap copies these from the host; replace with neutral content
    "etc/hostname": "",
    "etc/resolv.conf": "",
    "etc/machine-id": "",
    "etc/hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
}
# Keeps later `apt-get install` in derived images from bringing the docs back.
DPKG_EXCLUDES = """\
# Written by kernelhub: no documentation in the image, except copyright files.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""


# ---------------------------------------------------------------------------- lookup


def find_base_image(client: docker.DockerClient) -> str | None:
    """The local debootstrapped base (by label, never by pulling), or ``None``.

    Only tagged images count; prefers :data:`BASE_IMAGE`, else the newest other tag.
    """
    with docker_errors("looking for the kernelhub base image"):
        images = client.images.list(
            filters={"label": [f"{LABEL_BASE}={BASE_SUITE}", f"{LABEL_ROLE}=base"]}
        )
    tagged = [image for image in images if image.tags]  # not a failed build's leftovers
    if not tagged:
        return None
    for image in tagged:
        if BASE_IMAGE in image.tags:
            return BASE_IMAGE
    newest = max(tagged, key=lambda image: str(image.attrs.get("Created", "")))
    return str(newest.tags[0])


# ---------------------------------------------------------------------------- probe


def parse_probe(output: str, image: str) -> TargetPlatform:
    """Turn :data:`PROBE_SCRIPT`'s output into a :class:`TargetPlatform`, or explain why
    wheels cannot be built for that image."""
    try:
        data: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
        implementation = str(data["implementation"])
        major, minor = (int(part) for part in data["python"])
        machine = normalize_machine(str(data["machine"]))
        libc = data["libc"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ImageBuildError(
            f"could not read the Python version of base image {image}: "
            f"unexpected probe output {output.strip()[-300:]!r}"
        ) from exc
    if implementation != "cpython":
        raise ImageBuildError(
            f"base image {image} runs {implementation}; the kernel image needs CPython"
        )
    if not isinstance(libc, str) or not libc.startswith("glibc "):
        raise ImageBuildError(
            f"base image {image} does not use glibc (reported {libc!r}); the kernel's "
            "manylinux wheels need a glibc distribution such as Debian bookworm"
        )
    try:
        glibc_major, glibc_minor = (int(part) for part in libc.split()[1].split(".")[:2])
    except ValueError as exc:
        raise ImageBuildError(f"base image {image} reports glibc version {libc!r}") from exc
    return TargetPlatform(python=(major, minor), machine=machine, glibc=(glibc_major, glibc_minor))


def probe_platform(client: docker.DockerClient, image: str) -> TargetPlatform:
    """Run ``python3`` in ``image`` once, with no network and no privileges, and report
    its Python version, CPU architecture and glibc version."""
    with docker_errors(f"probing base image {image}"):
        # containers.run() pulls a missing image; never let it reach a registry.
        client.images.get(image)
        try:
            output = client.containers.run(
                image,
                entrypoint=["python3", "-c", PROBE_SCRIPT],
                command=[],
                network_mode="none",
                user="65534:65534",
                read_only=True,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                labels={LABEL_MANAGED: "true", LABEL_ROLE: "image-probe"},
                remove=True,
                stdout=True,
                stderr=False,
            )
        except docker.errors.ContainerError as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
            raise ImageBuildError(
                f"base image {image} has no working python3; the kernel image needs a base "
                "with python3 and its venv module" + format_tail(stderr.splitlines()[-20:])
            ) from exc
    text = output.decode(errors="replace") if isinstance(output, bytes) else str(output)
    return parse_probe(text, image)


# ---------------------------------------------------------------------------- debootstrap


def debootstrap_command(
    debootstrap: str, target: Path, mirror: str, *, suite: str = BASE_SUITE
) -> list[str]:
    """The debootstrap command line for a minimal base with Python and its venv module."""
    return [
        debootstrap,
        "--variant=minbase",
        "--include=" + ",".join(DEBOOTSTRAP_PACKAGES),
        "--components=main",
        suite,
        str(target),
        mirror,
    ]


def import_changes(*, suite: str = BASE_SUITE, version: str = __version__) -> list[str]:
    """The Dockerfile instructions ``docker import`` applies to the debootstrapped tree."""
    return [
        f"LABEL {LABEL_BASE}={suite}",
        f"LABEL {LABEL_ROLE}=base",
        f"LABEL {LABEL_MANAGED}=true",
        f"LABEL {LABEL_VERSION}={version}",
        f"ENV PATH={_STANDARD_PATH}",
        "ENV LANG=C.UTF-8",
        'CMD ["/bin/bash"]',
    ]


def build_debootstrap_base(
    client: docker.DockerClient,
    *,
    mirror: str,
    progress: Callable[[str], None],
    tag: str = BASE_IMAGE,
    workdir: Path | None = None,
) -> str:
    """Debootstrap a minimal Debian, trim it, import it as ``tag``; return the image id.

    Needs root and the ``debootstrap`` program; fails with :class:`ImageBuildError` saying
    what to install or how to run otherwise. The root file system is made in a temporary
    directory (under ``workdir`` if given) that is removed afterwards, success or not.
    """
    program = require_debootstrap()
    if shutil.which("tar") is None:
        raise ImageBuildError("tar is not installed; install it with `apt-get install -y tar`")
    scratch = Path(tempfile.mkdtemp(prefix="kernelhub-rootfs-", dir=workdir))
    rootfs = scratch / "rootfs"
    try:
        argv = debootstrap_command(program, rootfs, mirror)
        progress("$ " + " ".join(argv))
        started = time.monotonic()
        status, tail = run_streaming(argv, progress)
        if status != 0:
            log = _debootstrap_log_tail(rootfs)
            raise ImageBuildError(
                f"debootstrap of Debian {BASE_SUITE} from {mirror} failed (exit status "
                f"{status}); check that the mirror is reachable (set it with the mirror "
                "option)" + format_tail(log or tail)
            )
        progress(f"debootstrap finished in {time.monotonic() - started:.1f} s")
        freed = trim_rootfs(rootfs)
        progress(f"trimmed docs, man pages, locales and apt caches ({freed / 2**20:.1f} MiB)")
        started = time.monotonic()
        image_id = import_rootfs(client, rootfs, tag)
        progress(f"imported {tag} ({image_id[:19]}) in {time.monotonic() - started:.1f} s")
        return image_id
    finally:
        _remove_scratch(scratch, progress)


def require_debootstrap(*, search_path: str | None = None, euid: int | None = None) -> str:
    """The path of the ``debootstrap`` program, or :class:`ImageBuildError` saying what to
    install or how to run. ``search_path`` and ``euid`` default to this process's."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise ImageBuildError(
            "building the Debian base image with debootstrap needs root; run "
            "`sudo kernelhub image build`, or build on a machine where a registry is "
            "reachable with `kernelhub image build --base python-slim`"
        )
    if search_path is None:
        search_path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    program = shutil.which("debootstrap", path=search_path)
    if program is None:
        raise ImageBuildError(
            "debootstrap is not installed; it builds the kernel image's Debian base "
            "without a container registry. Install it with `apt-get install -y debootstrap`"
        )
    return program


def _debootstrap_log_tail(rootfs: Path) -> list[str]:
    try:
        text = (rootfs / "debootstrap" / "debootstrap.log").read_text(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-40:]


# ---------------------------------------------------------------------------- trim


def trim_rootfs(root: Path) -> int:
    """Remove what a kernel never reads from a debootstrapped tree; return bytes freed.

    Documentation (copyright files stay), man and info pages, locales (``locale.alias``
    stays), apt package lists and caches, logs, dpkg/debconf backups and temporary files.
    Host details debootstrap copied in (hostname, resolv.conf, hosts, machine-id) are
    replaced. Symbolic links are removed, never followed, so nothing outside ``root``
    is touched.
    """
    freed = 0
    for rel in _PURGE_DIRS:
        path = _inside(root, rel)
        if path is None:
            continue
        if path.is_dir() and not path.is_symlink():
            for child in list(path.iterdir()):
                freed += _remove(child)
        elif path.exists() or path.is_symlink():
            freed += _remove(path)
    for rel in _CLEAR_FILE_DIRS:
        path = _inside(root, rel)
        if path is not None and path.is_dir() and not path.is_symlink():
            for dirpath, _dirs, files in os.walk(path):
                for name in files:
                    freed += _remove(Path(dirpath) / name)
    for rel in _OLD_FILE_DIRS:
        path = _inside(root, rel)
        if path is not None and path.is_dir() and not path.is_symlink():
            for child in list(path.glob("*-old")):
                freed += _remove(child)
    freed += _trim_docs(root)
    freed += _trim_locales(root)
    for rel, content in _HOST_LEAKS.items():
        path = _inside(root, rel)
        if path is not None and (path.exists() or path.is_symlink()):
            freed += _remove(path)
            path.write_text(content)
    excludes = _inside(root, "etc/dpkg/dpkg.cfg.d")
    if excludes is not None and excludes.is_dir():
        (excludes / "kernelhub-nodoc").write_text(DPKG_EXCLUDES)
    return freed


def _trim_docs(root: Path) -> int:
    doc = _inside(root, "usr/share/doc")
    if doc is None or not doc.is_dir() or doc.is_symlink():
        return 0
    freed = 0
    for package in list(doc.iterdir()):
        if package.is_dir() and not package.is_symlink():
            for child in list(package.iterdir()):
                if child.name != "copyright":
                    freed += _remove(child)
            if not any(package.iterdir()):
                package.rmdir()
        else:
            freed += _remove(package)
    return freed


def _trim_locales(root: Path) -> int:
    locale = _inside(root, "usr/share/locale")
    if locale is None or not locale.is_dir() or locale.is_symlink():
        return 0
    return sum(_remove(child) for child in list(locale.iterdir()) if child.name != "locale.alias")


def _inside(root: Path, rel: str) -> Path | None:
    """``root/rel`` if none of its parent directories below ``root`` is a symlink."""
    path = root
    parts = Path(rel).parts
    for part in parts[:-1]:
        path = path / part
        if path.is_symlink() or not path.is_dir():
            return None
    return path / parts[-1]


def _remove(path: Path) -> int:
    """Delete a file, symlink or directory tree without following links; return its size."""
    try:
        if path.is_symlink() or not path.is_dir():
            size = path.lstat().st_size
            path.unlink()
            return size
        size = sum(
            (Path(d) / f).lstat().st_size for d, _dirs, files in os.walk(path) for f in files
        )
        shutil.rmtree(path)
        return size
    except FileNotFoundError:
        return 0


# ---------------------------------------------------------------------------- import


def import_rootfs(client: docker.DockerClient, rootfs: Path, tag: str) -> str:
    """Stream ``rootfs`` as a tar into ``docker import`` (no temporary tarball); return the
    new image's id. Device nodes and ``/proc``, ``/sys`` contents are left out; extended
    attributes (so file capabilities) are not carried over."""
    repository, _, tag_name = tag.rpartition(":")
    if not repository or "/" in tag_name:
        repository, tag_name = tag, "latest"
    argv = [
        "tar",
        "--create",
        "--file=-",
        "--directory",
        str(rootfs),
        "--numeric-owner",
        "--exclude=./dev/*",
        "--exclude=./proc/*",
        "--exclude=./sys/*",
        ".",
    ]
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors
        )
        try:
            assert proc.stdout is not None
            with docker_errors(f"importing the base image {tag}"):
                response = client.api.import_image(
                    src=_chunks(proc.stdout),
                    repository=repository,
                    tag=tag_name,
                    changes=import_changes(),
                    stream_src=True,
                )
        finally:
            if proc.poll() is None:
                proc.kill()
            status = proc.wait()
        if status != 0:
            errors.seek(0)
            detail = errors.read().decode(errors="replace").splitlines()[-20:]
            raise ImageBuildError(
                f"tar of {rootfs} failed (exit status {status})" + format_tail(detail)
            )
    for line in str(response).splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict) and message.get("error"):
            raise ImageBuildError(f"docker import of {tag} failed: {message['error']}")
    with docker_errors(f"inspecting the imported base image {tag}"):
        return str(client.images.get(tag).id)


def _chunks(stream: IO[bytes]) -> Iterator[bytes]:
    while chunk := stream.read(_CHUNK_BYTES):
        yield chunk


# ---------------------------------------------------------------------------- cleanup


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` (debootstrap mounts /proc and /sys in the target
    and may leave them if it fails), deepest first."""
    prefix = str(path.resolve())
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        point = (
            fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
        ).replace("\\134", "\\")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)


def _remove_scratch(scratch: Path, progress: Callable[[str], None]) -> None:
    for point in _mounts_under(scratch):
        subprocess.run(["umount", "--lazy", point], check=False, capture_output=True)
    if _mounts_under(scratch):
        progress(f"warning: {scratch} still has mounts below it; unmount and remove it by hand")
        return
    started = time.monotonic()
    shutil.rmtree(scratch, ignore_errors=True)
    progress(f"removed the temporary root file system in {time.monotonic() - started:.1f} s")
