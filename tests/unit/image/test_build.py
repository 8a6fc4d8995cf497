"""The image builder's decisions, with data: wheel platform tags and pip arguments, the
wheel cache key and cache reuse, the base probe, the rootfs trim, the build-log parser,
the build context, check_image's verdicts and its error translation, and the Dockerfile
and lock file against the contract constants. The Docker tier builds the real image."""

from __future__ import annotations

import io
import json
import re
import stat
import sys
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import docker.errors
import pytest
import requests.exceptions

from kernelhub import KERNEL_PROTOCOL_VERSION, __version__
from kernelhub.errors import BackendUnavailableError, ImageBuildError, ImageError, KernelhubError
from kernelhub.image import (
    BASE_IMAGE,
    CONNECTION_FILE,
    DEFAULT_IMAGE,
    IPC_DIR,
    KERNEL_COMMAND,
    KERNEL_PACKAGE_ROOT,
    KERNEL_PYTHON,
    LABEL_BASE,
    LABEL_PROTOCOL,
    LABEL_PYTHON,
    LABEL_ROLE,
    LABEL_VERSION,
    MPLCONFIG_SEED,
    SANDBOX_GID,
    SANDBOX_UID,
    WORKSPACE,
)
from kernelhub.image.base import (
    DPKG_EXCLUDES,
    debootstrap_command,
    find_base_image,
    import_changes,
    parse_probe,
    require_debootstrap,
    trim_rootfs,
)
from kernelhub.image.build import (
    BuildLog,
    ImageInfo,
    check_image,
    image_info,
    kernel_image_dir,
    resolve_base,
    write_context,
)
from kernelhub.image.wheels import (
    MANIFEST,
    TargetPlatform,
    cache_key,
    download_wheels,
    locked_requirements,
    normalize_machine,
    pip_download_command,
    platform_tags,
)

BOOKWORM_X86 = TargetPlatform(python=(3, 11), machine="x86_64", glibc=(2, 36))
BOOKWORM_ARM = TargetPlatform(python=(3, 11), machine="aarch64", glibc=(2, 36))
KERNEL_IMAGE = kernel_image_dir()


def pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


# ---------------------------------------------------------------------------- wheels


def test_platform_tags_cover_every_glibc_from_the_base_down_to_2_17() -> None:
    tags = platform_tags(BOOKWORM_X86)
    assert tags[0] == "manylinux_2_36_x86_64"
    assert tags[-2:] == ["manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    assert tags[:-1] == [f"manylinux_2_{n}_x86_64" for n in range(36, 16, -1)]


def test_platform_tags_follow_the_architecture() -> None:
    assert platform_tags(BOOKWORM_ARM)[0] == "manylinux_2_36_aarch64"
    assert platform_tags(BOOKWORM_ARM)[-1] == "manylinux2014_aarch64"
    assert all(t.endswith("_aarch64") for t in platform_tags(BOOKWORM_ARM))
    focal = TargetPlatform(python=(3, 12), machine="aarch64", glibc=(2, 31))
    assert platform_tags(focal)[0] == "manylinux_2_31_aarch64"
    # No legacy manylinux2014 tag exists for riscv64.
    riscv = TargetPlatform(python=(3, 11), machine="riscv64", glibc=(2, 36))
    assert platform_tags(riscv)[-1] == "manylinux_2_17_riscv64"


def test_platform_tags_refuse_a_glibc_too_old_for_manylinux2014() -> None:
    with pytest.raises(ImageBuildError, match=r"glibc 2\.12.*2\.17 or newer"):
        platform_tags(TargetPlatform(python=(3, 11), machine="x86_64", glibc=(2, 12)))


@pytest.mark.parametrize(
    ("given", "expected"),
    [("x86_64", "x86_64"), ("AMD64", "x86_64"), ("arm64", "aarch64"), ("aarch64", "aarch64")],
)
def test_normalize_machine(given: str, expected: str) -> None:
    assert normalize_machine(given) == expected


def test_pip_download_fetches_exactly_the_pinned_binary_wheels_for_the_target() -> None:
    argv = pip_download_command(
        Path("/k/requirements.txt"), Path("/cache/x"), BOOKWORM_ARM, python="/py"
    )
    assert argv[:4] == ["/py", "-m", "pip", "download"]
    assert pairs(argv, "--requirement") == ["/k/requirements.txt"]
    assert pairs(argv, "--dest") == ["/cache/x"]
    assert "--only-binary=:all:" in argv and "--no-deps" in argv
    assert pairs(argv, "--implementation") == ["cp"]
    assert pairs(argv, "--python-version") == ["3.11"]
    assert pairs(argv, "--abi") == ["cp311"]
    assert pairs(argv, "--platform") == platform_tags(BOOKWORM_ARM)
    # The index is whatever pip is configured with; we never override it.
    assert not {"--index-url", "-i", "--extra-index-url"} & set(argv)


def test_pip_download_uses_the_target_python_not_the_hosts() -> None:
    argv = pip_download_command(
        Path("r.txt"), Path("d"), TargetPlatform((3, 12), "x86_64", (2, 39)), python="/py"
    )
    assert pairs(argv, "--python-version") == ["3.12"]
    assert pairs(argv, "--abi") == ["cp312"]
    assert pairs(argv, "--platform")[0] == "manylinux_2_39_x86_64"


def test_cache_key_ignores_comments_order_and_blanks_but_not_pins_or_platform() -> None:
    lock = "numpy==2.4.6\npandas==3.1.1\n"
    key = cache_key(lock, BOOKWORM_X86)
    assert re.fullmatch(r"cp311-x86_64-glibc2\.36-[0-9a-f]{16}", key)
    assert cache_key("# header\n\npandas==3.1.1   # why\nnumpy==2.4.6\n", BOOKWORM_X86) == key
    assert cache_key("numpy==2.4.7\npandas==3.1.1\n", BOOKWORM_X86) != key
    assert cache_key(lock, BOOKWORM_ARM) != key
    assert cache_key(lock, TargetPlatform((3, 12), "x86_64", (2, 36))) != key
    assert cache_key(lock, TargetPlatform((3, 11), "x86_64", (2, 39))) != key


FAKE_PIP = """\
import sys
from pathlib import Path
argv = sys.argv[1:]
assert argv[:3] == ["-m", "pip", "download"], argv
Path({calls!r}).open("a").write("call\\n")
if {fail!r}:
    print("ERROR: No matching distribution found for numpy==9", flush=True)
    sys.exit(1)
dest = Path(argv[argv.index("--dest") + 1])
for line in Path(argv[argv.index("--requirement") + 1]).read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        (dest / f"{{name}}-{{version}}-py3-none-any.whl").write_bytes(b"wheel")
        print(f"Saved {{name}}", flush=True)
"""


def fake_pip(tmp_path: Path, *, fail: bool = False) -> tuple[str, Path]:
    """A stand-in for ``python`` whose ``-m pip download`` writes one file per pin."""
    calls = tmp_path / "calls"
    script = tmp_path / "fakepython"
    script.write_text(f"#!{sys.executable}\n" + FAKE_PIP.format(calls=str(calls), fail=fail))
    script.chmod(0o755)
    return str(script), calls


def test_download_wheels_then_reuses_the_cache_offline(tmp_path: Path) -> None:
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# lock\ndill==0.4.1\nnumpy==2.4.6\n")
    python, calls = fake_pip(tmp_path)
    lines: list[str] = []

    wheels = download_wheels(
        requirements, tmp_path / "cache", BOOKWORM_X86, lines.append, python=python
    )
    assert sorted(w.name for w in wheels) == [
        "dill-0.4.1-py3-none-any.whl",
        "numpy-2.4.6-py3-none-any.whl",
    ]
    assert "Saved dill" in lines  # pip's output is streamed
    entry = tmp_path / "cache" / cache_key(requirements.read_text(), BOOKWORM_X86)
    assert wheels[0].parent == entry and (entry / MANIFEST).is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [entry.name]  # no .partial left

    again = download_wheels(
        requirements, tmp_path / "cache", BOOKWORM_X86, lines.append, python=python
    )
    assert again == wheels
    assert calls.read_text().count("call") == 1


def test_an_incomplete_cache_entry_is_downloaded_again(tmp_path: Path) -> None:
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("dill==0.4.1\n")
    python, calls = fake_pip(tmp_path)
    entry = tmp_path / "cache" / cache_key(requirements.read_text(), BOOKWORM_X86)
    entry.mkdir(parents=True)
    (entry / "dill-0.4.1-py3-none-any.whl").write_bytes(b"half")  # no manifest: interrupted

    wheels = download_wheels(
        requirements, tmp_path / "cache", BOOKWORM_X86, lambda _: None, python=python
    )
    assert [w.name for w in wheels] == ["dill-0.4.1-py3-none-any.whl"]
    assert calls.read_text().count("call") == 1


def test_a_failed_download_says_so_with_pips_output_and_caches_nothing(tmp_path: Path) -> None:
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("numpy==9\n")
    python, _ = fake_pip(tmp_path, fail=True)
    with pytest.raises(ImageBuildError, match=r"pip download .* failed \(exit status 1\)") as info:
        download_wheels(
            requirements, tmp_path / "cache", BOOKWORM_X86, lambda _: None, python=python
        )
    assert "No matching distribution found for numpy==9" in str(info.value)
    assert list((tmp_path / "cache").iterdir()) == []


# ---------------------------------------------------------------------------- base


def probe_output(**overrides: Any) -> str:
    data = {
        "implementation": "cpython",
        "python": [3, 11],
        "machine": "x86_64",
        "libc": "glibc 2.36",
    }
    return json.dumps(data | overrides) + "\n"


def test_parse_probe_reads_python_machine_and_glibc() -> None:
    assert parse_probe(probe_output(), "b") == BOOKWORM_X86
    assert parse_probe(probe_output(machine="arm64"), "b") == BOOKWORM_ARM


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"libc": None}, "does not use glibc"),  # musl (alpine)
        ({"implementation": "pypy"}, "needs CPython"),
        ({"python": "3.11"}, "unexpected probe output"),
    ],
)
def test_parse_probe_refuses_bases_our_wheels_cannot_fit(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ImageBuildError, match=message):
        parse_probe(probe_output(**overrides), "some/base")


def test_parse_probe_reports_garbage() -> None:
    with pytest.raises(ImageBuildError, match="could not read the Python version of base image x"):
        parse_probe("python3: not found\n", "x")


def test_debootstrap_command_is_minbase_with_python_venv_and_certificates(tmp_path: Path) -> None:
    argv = debootstrap_command("/usr/sbin/debootstrap", tmp_path, "http://mirror/debian")
    assert argv == [
        "/usr/sbin/debootstrap",
        "--variant=minbase",
        "--include=python3,python3-venv,ca-certificates",
        "--components=main",
        "bookworm",
        str(tmp_path),
        "http://mirror/debian",
    ]


def test_import_labels_the_base_so_auto_finds_it() -> None:
    changes = import_changes(version="9.9")
    assert f"LABEL {LABEL_BASE}=bookworm" in changes
    assert f"LABEL {LABEL_ROLE}=base" in changes
    assert "LABEL org.kernelhub.managed=true" in changes
    assert f"LABEL {LABEL_VERSION}=9.9" in changes
    assert any(c.startswith("ENV PATH=/usr/local/sbin:") for c in changes)


def test_require_debootstrap_names_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError, match=r"apt-get install -y debootstrap"):
        require_debootstrap(search_path=str(tmp_path), euid=0)
    with pytest.raises(ImageBuildError, match="needs root"):
        require_debootstrap(search_path=str(tmp_path), euid=1000)
    fake = tmp_path / "debootstrap"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert require_debootstrap(search_path=str(tmp_path), euid=0) == str(fake)


def make_rootfs(root: Path, outside: Path) -> None:
    files = {
        "usr/share/doc/bash/copyright": "GPL",
        "usr/share/doc/bash/changelog.Debian.gz": "x" * 1000,
        "usr/share/doc/bash/README": "read me",
        "usr/share/doc/libfoo/changelog.gz": "x",
        "usr/share/man/man1/bash.1.gz": "x" * 500,
        "usr/share/info/dir": "x",
        "usr/share/locale/de/LC_MESSAGES/bash.mo": "x",
        "usr/share/locale/locale.alias": "alias",
        "usr/share/zoneinfo/UTC": "keep",
        "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease": "x" * 2000,
        "var/cache/apt/pkgcache.bin": "x" * 3000,
        "var/cache/apt/archives/bash_5.2.deb": "x",
        "var/cache/debconf/config.dat-old": "x",
        "var/cache/debconf/config.dat": "keep",
        "var/lib/dpkg/status-old": "x",
        "var/lib/dpkg/status": "keep",
        "var/log/apt/history.log": "x",
        "var/log/dpkg.log": "x",
        "etc/hostname": "buildhost",
        "etc/hosts": "10.0.0.7 buildhost",
        "etc/resolv.conf": "nameserver 10.0.0.1",
        "etc/dpkg/dpkg.cfg.d/excludes-placeholder": "",
        "tmp/junk": "x",
    }
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(content)
    (root / "var/lib/apt/lists/partial").mkdir()
    # Absolute symlinks in a rootfs point at the *host* when followed; trimming must not.
    outside.mkdir()
    (outside / "precious").write_text("host data")
    (root / "usr/share/doc/evil").symlink_to(outside)
    (root / "usr/share/man/man8").symlink_to(outside)


def test_trim_rootfs_keeps_copyrights_and_drops_docs_caches_and_host_leaks(tmp_path: Path) -> None:
    root, outside = tmp_path / "rootfs", tmp_path / "host"
    make_rootfs(root, outside)

    freed = trim_rootfs(root)

    remaining = sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()
    )
    assert remaining == [
        "etc/dpkg/dpkg.cfg.d/excludes-placeholder",
        "etc/dpkg/dpkg.cfg.d/kernelhub-nodoc",
        "etc/hostname",
        "etc/hosts",
        "etc/resolv.conf",
        "usr/share/doc/bash/copyright",
        "usr/share/locale/locale.alias",
        "usr/share/zoneinfo/UTC",
        "var/cache/debconf/config.dat",
        "var/lib/dpkg/status",
    ]
    assert freed >= 1000 + 500 + 2000 + 3000
    assert (root / "etc/hostname").read_text() == ""
    assert "buildhost" not in (root / "etc/hosts").read_text()
    assert (root / "etc/resolv.conf").read_text() == ""
    assert (root / "var/lib/apt/lists/partial").is_dir()
    assert (root / "etc/dpkg/dpkg.cfg.d/kernelhub-nodoc").read_text() == DPKG_EXCLUDES
    assert (outside / "precious").read_text() == "host data"


def test_trim_rootfs_replaces_a_symlinked_resolv_conf_without_writing_through_it(
    tmp_path: Path,
) -> None:
    root, host = tmp_path / "rootfs", tmp_path / "host-resolv.conf"
    (root / "etc").mkdir(parents=True)
    host.write_text("nameserver 10.0.0.1")
    (root / "etc/resolv.conf").symlink_to(host)
    trim_rootfs(root)
    assert host.read_text() == "nameserver 10.0.0.1"
    assert not (root / "etc/resolv.conf").is_symlink()


# ---------------------------------------------------------------------------- fakes


class FakeImage:
    def __init__(
        self,
        labels: Mapping[str, str] | None,
        *,
        tags: list[str] | None = None,
        image_id: str = "sha256:" + "ab" * 32,
        size: int = 400 * 2**20,
        created: str = "2026-01-01T00:00:00Z",
    ) -> None:
        self.labels = dict(labels) if labels is not None else None
        self.tags = tags or []
        self.id = image_id
        self.attrs = {"Size": size, "Created": created}


class FakeImages:
    def __init__(self, images: dict[str, FakeImage], raises: BaseException | None = None) -> None:
        self.images = images
        self.raises = raises
        self.pulled: list[tuple[str, str]] = []
        self.list_filters: list[object] = []

    def get(self, name: str) -> FakeImage:
        if self.raises is not None:
            raise self.raises
        if name not in self.images:
            raise docker.errors.ImageNotFound(f"No such image: {name}")
        return self.images[name]

    def list(self, filters: dict[str, list[str]]) -> list[FakeImage]:
        self.list_filters.append(filters)
        wanted = dict(f.split("=", 1) for f in filters["label"])
        return [
            image
            for image in {id(i): i for i in self.images.values()}.values()
            if image.labels and all(image.labels.get(k) == v for k, v in wanted.items())
        ]

    def pull(self, repository: str, tag: str) -> None:
        self.pulled.append((repository, tag))


class FakeClient:
    def __init__(self, images: dict[str, FakeImage], raises: BaseException | None = None) -> None:
        self.images = FakeImages(images, raises)


GOOD_LABELS = {
    LABEL_PROTOCOL: KERNEL_PROTOCOL_VERSION,
    LABEL_VERSION: __version__,
    LABEL_PYTHON: "3.11",
    "org.kernelhub.managed": "true",
}


# ---------------------------------------------------------------------------- check_image


def test_check_image_accepts_an_image_for_our_protocol() -> None:
    client = FakeClient({DEFAULT_IMAGE: FakeImage(GOOD_LABELS)})
    info = check_image(client, DEFAULT_IMAGE)  # type: ignore[arg-type]
    assert info == ImageInfo(
        name=DEFAULT_IMAGE,
        id="sha256:" + "ab" * 32,
        protocol=KERNEL_PROTOCOL_VERSION,
        kernelhub_version=__version__,
        python_version="3.11",
        size_bytes=400 * 2**20,
    )


def test_check_image_says_how_to_build_a_missing_image() -> None:
    with pytest.raises(ImageError) as info:
        check_image(FakeClient({}), "kernelhub/kernel:p1")  # type: ignore[arg-type]
    assert str(info.value) == (
        "kernel image kernelhub/kernel:p1 not found; build it with `kernelhub image build`"
    )
    assert isinstance(info.value.__cause__, docker.errors.ImageNotFound)


def test_check_image_refuses_another_protocol_naming_both_versions() -> None:
    old = FakeImage(GOOD_LABELS | {LABEL_PROTOCOL: "0", LABEL_VERSION: "0.0.9"})
    with pytest.raises(ImageError) as info:
        check_image(FakeClient({"k:old": old}), "k:old")  # type: ignore[arg-type]
    message = str(info.value)
    assert "k:old" in message
    assert "protocol '0'" in message and f"protocol {KERNEL_PROTOCOL_VERSION!r}" in message
    assert "kernelhub 0.0.9" in message
    assert "kernelhub image build" in message


@pytest.mark.parametrize("labels", [None, {}, {"maintainer": "someone"}])
def test_check_image_refuses_an_image_that_is_not_a_kernel_image(
    labels: dict[str, str] | None,
) -> None:
    with pytest.raises(ImageError, match=r"not a kernelhub kernel image.*KERNELHUB_DOCKER__IMAGE"):
        check_image(FakeClient({"python:3.11": FakeImage(labels)}), "python:3.11")  # type: ignore[arg-type]


def test_image_info_does_not_need_the_optional_labels() -> None:
    info = image_info("k", "sha256:1", {LABEL_PROTOCOL: KERNEL_PROTOCOL_VERSION}, 0)
    assert info.kernelhub_version is None and info.python_version is None


FOREIGN_ERRORS: list[tuple[BaseException, type[KernelhubError]]] = [
    (docker.errors.APIError("500 Server Error", explanation="boom"), ImageError),
    (docker.errors.NotFound("404"), ImageError),
    (docker.errors.DockerException("something odd"), ImageError),
    (
        docker.errors.DockerException(
            "Error while fetching server API version: Connection aborted"
        ),
        BackendUnavailableError,
    ),
    (requests.exceptions.ConnectionError("refused"), BackendUnavailableError),
    (requests.exceptions.ReadTimeout("slow"), ImageError),
]


@pytest.mark.parametrize(("foreign", "ours"), FOREIGN_ERRORS, ids=lambda v: type(v).__name__)
def test_every_docker_error_is_translated_with_its_cause(
    foreign: BaseException, ours: type[KernelhubError]
) -> None:
    with pytest.raises(ours) as info:
        check_image(FakeClient({}, raises=foreign), DEFAULT_IMAGE)  # type: ignore[arg-type]
    assert info.value.__cause__ is foreign
    assert DEFAULT_IMAGE in str(info.value)


# ---------------------------------------------------------------------------- base choice


def test_auto_uses_the_local_base_and_never_pulls() -> None:
    base = FakeImage({LABEL_BASE: "bookworm", LABEL_ROLE: "base"}, tags=[BASE_IMAGE])
    # A kernel image inherits org.kernelhub.base from its base; it must not pass for one.
    kernel = FakeImage(
        GOOD_LABELS | {LABEL_BASE: "bookworm", LABEL_ROLE: "kernel"}, tags=[DEFAULT_IMAGE]
    )
    client = FakeClient({BASE_IMAGE: base, DEFAULT_IMAGE: kernel})
    assert resolve_base(client, "auto", mirror="m", progress=lambda _: None) == BASE_IMAGE  # type: ignore[arg-type]
    assert client.images.pulled == []


def test_find_base_image_ignores_untagged_leftovers_and_prefers_the_standard_tag() -> None:
    untagged = FakeImage({LABEL_BASE: "bookworm", LABEL_ROLE: "base"}, created="2027")
    assert find_base_image(FakeClient({"x": untagged})) is None  # type: ignore[arg-type]
    other = FakeImage({LABEL_BASE: "bookworm", LABEL_ROLE: "base"}, tags=["mine:1"], created="2027")
    standard = FakeImage({LABEL_BASE: "bookworm", LABEL_ROLE: "base"}, tags=[BASE_IMAGE])
    client = FakeClient({"x": untagged, "mine:1": other, BASE_IMAGE: standard})
    assert find_base_image(client) == BASE_IMAGE  # type: ignore[arg-type]
    assert find_base_image(FakeClient({"mine:1": other})) == "mine:1"  # type: ignore[arg-type]


def test_an_explicit_base_must_be_local_and_is_never_pulled() -> None:
    client = FakeClient({})
    with pytest.raises(ImageBuildError, match=r"not present locally.*docker pull ubuntu:24\.04"):
        resolve_base(client, "ubuntu:24.04", mirror="m", progress=lambda _: None)  # type: ignore[arg-type]
    assert client.images.pulled == []
    client = FakeClient({"ubuntu:24.04": FakeImage(None)})
    assert (
        resolve_base(client, "ubuntu:24.04", mirror="m", progress=lambda _: None) == "ubuntu:24.04"
    )  # type: ignore[arg-type]


def test_python_slim_is_pulled_only_when_asked_for_and_missing() -> None:
    client = FakeClient({})
    lines: list[str] = []
    assert (
        resolve_base(client, "python-slim", mirror="m", progress=lines.append) == "python:3.11-slim"
    )  # type: ignore[arg-type]
    assert client.images.pulled == [("python", "3.11-slim")]
    assert any("pulling python:3.11-slim" in line for line in lines)


# ---------------------------------------------------------------------------- build log


def test_build_log_joins_split_lines_tracks_steps_and_keeps_the_failing_steps_tail() -> None:
    log = BuildLog()
    shown: list[str] = []
    for chunk in [
        {"stream": "Step 1/3 : FROM kernelhub/base:bookworm\n"},
        {"stream": " ---> 26a3240fd0d1\n"},
        {"stream": "Step 2/3 : RUN pip install\n"},
        {"stream": "Processing /build/wheels/num"},
        {"stream": "py.whl\nInstalling\n"},
        {
            "error": "The command '/bin/sh -c pip install' returned a non-zero code: 1",
            "errorDetail": {"code": 1, "message": "ignored: error wins"},
        },
    ]:
        shown += log.feed(chunk)
    shown += log.finish()
    assert "Processing /build/wheels/numpy.whl" in shown
    assert log.step == "Step 2/3 : RUN pip install"
    assert list(log.tail) == [
        "Processing /build/wheels/numpy.whl",
        "Installing",
        "ERROR: The command '/bin/sh -c pip install' returned a non-zero code: 1",
    ]
    assert log.error == "The command '/bin/sh -c pip install' returned a non-zero code: 1"
    assert log.image_id is None


def test_build_log_strips_the_colour_codes_of_stderr() -> None:
    log = BuildLog()
    lines = log.feed(
        {"stream": "\x1b[91mOSError: [Errno 101] Network is unreachable\n\x1b[0mRemoving x\n"}
    )
    assert lines == ["OSError: [Errno 101] Network is unreachable", "Removing x"]


def test_build_log_takes_the_image_id_from_aux() -> None:
    log = BuildLog()
    assert log.feed({"aux": {"ID": "sha256:feed"}}) == []
    assert log.feed({"stream": "Successfully built feed\n"}) == ["Successfully built feed"]
    assert log.image_id == "sha256:feed" and log.error is None


def test_build_log_uses_error_detail_when_there_is_no_error_string() -> None:
    log = BuildLog()
    log.feed({"errorDetail": {"message": "no space left on device"}})
    assert log.error == "no space left on device"


# ---------------------------------------------------------------------------- context


def test_build_context_holds_the_sources_and_wheels_owned_by_root(tmp_path: Path) -> None:
    sources = tmp_path / "kernel-image"
    (sources / "kernelhub_kernel" / "__pycache__").mkdir(parents=True)
    (sources / "Dockerfile").write_text("FROM scratch\n")
    (sources / "requirements.txt").write_text("dill==0.4.1\n")
    (sources / "kernelhub_kernel" / "__init__.py").write_text("")
    (sources / "kernelhub_kernel" / "supervisor.py").write_text("")
    (sources / "kernelhub_kernel" / "supervisor.py").chmod(0o600)  # a restrictive umask
    (sources / "kernelhub_kernel" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"")
    wheel = tmp_path / "dill-0.4.1-py3-none-any.whl"
    wheel.write_bytes(b"PK")

    buffer = io.BytesIO()
    write_context(buffer, sources, [wheel])
    buffer.seek(0)
    with tarfile.open(fileobj=buffer) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == [
        "Dockerfile",
        "kernelhub_kernel",
        "kernelhub_kernel/__init__.py",
        "kernelhub_kernel/supervisor.py",
        "requirements.txt",
        "wheelhouse",
        "wheels",
        "wheels/dill-0.4.1-py3-none-any.whl",
    ]
    assert all(m.uid == 0 and m.gid == 0 for m in members.values())
    assert stat.S_IMODE(members["kernelhub_kernel/supervisor.py"].mode) == 0o644
    assert stat.S_IMODE(members["wheels"].mode) == 0o755


def test_build_context_takes_a_profile_lock_and_a_wheelhouse(tmp_path: Path) -> None:
    sources = tmp_path / "kernel-image"
    (sources / "kernelhub_kernel").mkdir(parents=True)
    (sources / "Dockerfile").write_text("FROM scratch\n")
    (sources / "requirements.txt").write_text("dill==0.4.1\n")
    seeded = tmp_path / "six-1.17.0-py2.py3-none-any.whl"
    seeded.write_bytes(b"PK")

    buffer = io.BytesIO()
    write_context(buffer, sources, [], [seeded], requirements="dill==0.4.1\nscipy==1.0\n")
    buffer.seek(0)
    with tarfile.open(fileobj=buffer) as tar:
        names = sorted(tar.getnames())
        lock = tar.extractfile("requirements.txt")
        assert lock is not None and lock.read() == b"dill==0.4.1\nscipy==1.0\n"
    assert "wheelhouse/six-1.17.0-py2.py3-none-any.whl" in names


def test_the_real_kernel_image_sources_are_found() -> None:
    assert (KERNEL_IMAGE / "Dockerfile").is_file()
    assert (KERNEL_IMAGE / "requirements.txt").is_file()
    assert (KERNEL_IMAGE / "kernelhub_kernel" / "__init__.py").is_file()


# ---------------------------------------------------------------------------- contract


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (KERNEL_IMAGE / "Dockerfile").read_text().replace("\\\n", " ")
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in rest.split())
    return env


def test_dockerfile_runs_the_contract_command_as_the_sandbox_user() -> None:
    stage = final_stage()
    last = {keyword: rest for keyword, rest in stage}
    assert json.loads(last["CMD"]) == list(KERNEL_COMMAND)
    assert KERNEL_COMMAND[0] == KERNEL_PYTHON and KERNEL_COMMAND[-1] == CONNECTION_FILE
    assert last["USER"] == f"{SANDBOX_UID}:{SANDBOX_GID}"
    assert last["WORKDIR"] == WORKSPACE
    assert last["ENTRYPOINT"] == "[]"
    body = " ".join(rest for keyword, rest in stage if keyword == "RUN")
    assert f"--uid {SANDBOX_UID} --gid {SANDBOX_GID} --home-dir {WORKSPACE}" in body
    assert f"groupadd --gid {SANDBOX_GID}" in body
    assert f"chown {SANDBOX_UID}:{SANDBOX_GID} {WORKSPACE}" in body
    assert IPC_DIR in body


def test_dockerfile_environment_matches_the_contract() -> None:
    env = env_of(final_stage())
    assert env["PYTHONPATH"] == KERNEL_PACKAGE_ROOT
    assert env["HOME"] == WORKSPACE
    assert env["MPLBACKEND"] == "module://matplotlib_inline.backend_inline"
    assert env["MPLCONFIGDIR"] == "/tmp/.matplotlib"
    assert env["IPYTHONDIR"] == "/tmp/.ipython"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["PATH"].split(":")[0] == str(Path(KERNEL_PYTHON).parent)
    assert "" not in env["PATH"].split(":")  # an empty entry would mean the cwd


def test_dockerfile_prebuilds_fonts_and_bytecode_and_strips_setuid() -> None:
    text = " ".join(rest for _, rest in dockerfile_instructions())
    assert f"MPLCONFIGDIR={MPLCONFIG_SEED}" in text
    assert "compileall" in text and "/opt/kernelhub" in text
    assert "find / -xdev -perm /6000 -type f -exec chmod ug-s {} +" in text
    assert "--no-index" in text
    # Only the final stage ships; the wheels never reach it.
    assert not any(k == "COPY" and "wheels" in rest for k, rest in final_stage())


def test_requirements_are_a_complete_exact_lock() -> None:
    lines = locked_requirements((KERNEL_IMAGE / "requirements.txt").read_text())
    names = [line.split("==")[0] for line in lines]
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9.-]*==[0-9][0-9A-Za-z.+!-]*", line) for line in lines)
    assert len(names) == len(set(names))
    roots = {
        "ipykernel",
        "jupyter-client",
        "pyzmq",
        "dill",
        "numpy",
        "pandas",
        "matplotlib",
        "matplotlib-inline",
    }
    assert roots <= set(names)
    # ipykernel 7 requires debugpy, so the lock keeps it.
    assert "debugpy" in names


def test_profile_locks_add_to_the_slim_lock_and_refuse_loose_or_double_pins(
    tmp_path: Path,
) -> None:
    from kernelhub.image.build import profile_lock

    (tmp_path / "requirements.txt").write_text("# slim\nnumpy==2.4.6\n")
    (tmp_path / "requirements-data-science.txt").write_text("scipy==1.17.1\n")
    assert profile_lock(tmp_path, "slim") == "numpy==2.4.6\n"
    assert profile_lock(tmp_path, "data-science") == "numpy==2.4.6\nscipy==1.17.1\n"
    mine = tmp_path / "mine.txt"
    mine.write_text("tabulate==0.10.0\n")
    assert "tabulate==0.10.0" in profile_lock(tmp_path, "slim", mine)
    mine.write_text("tabulate\n")
    with pytest.raises(ImageBuildError, match="not pinned"):
        profile_lock(tmp_path, "slim", mine)
    mine.write_text("numpy==1.0\n")
    with pytest.raises(ImageBuildError, match="twice"):
        profile_lock(tmp_path, "slim", mine)
    with pytest.raises(ImageBuildError, match="unknown image profile"):
        profile_lock(tmp_path, "huge")


def test_the_shipped_data_science_lock_adds_the_analysis_stack_without_repinning() -> None:
    from kernelhub.image.build import kernel_image_dir, profile_lock

    lock = profile_lock(kernel_image_dir(), "data-science")
    names = {line.split("==")[0] for line in lock.split()}
    wanted = {"scipy", "scikit-learn", "seaborn", "statsmodels", "pyarrow", "openpyxl",
              "polars", "duckdb", "requests", "numpy", "pandas", "matplotlib"}  # fmt: skip
    assert wanted <= names
