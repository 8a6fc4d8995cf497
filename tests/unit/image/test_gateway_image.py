"""The gateway image builder's pure parts, with data: the pip wheel command, picking
kernelhub's wheel, finding the source checkout, the build context; and the files it builds
from, read against each other: the Dockerfile (offline install, labels, entry point), the
lock (exact, complete against pyproject.toml and against the installed distributions) and
compose.yaml as written (the Docker tier checks it as Docker Compose resolves it)."""

from __future__ import annotations

import importlib.metadata
import io
import json
import re
import stat
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from kernelhub import __version__
from kernelhub.config import GatewaySettings
from kernelhub.errors import ImageBuildError
from kernelhub.image import LABEL_MANAGED, LABEL_ROLE, LABEL_VERSION
from kernelhub.image.gateway import (
    GATEWAY_IMAGE_DIR,
    GATEWAY_VENV,
    find_source_checkout,
    gateway_labels,
    gateway_tag,
    kernelhub_wheel,
    pip_wheel_command,
    write_gateway_context,
)
from kernelhub.image.wheels import locked_requirements
from tests.docker.test_compose import Volume, environment, published_ports, volumes

REPO = find_source_checkout()
SOURCES = REPO / GATEWAY_IMAGE_DIR
# What the image's Python is: Debian bookworm's CPython 3.11 on Linux.
TARGET_MARKERS = {
    "python_version": "3.11",
    "python_full_version": "3.11.2",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


# ---------------------------------------------------------------------------- builder


def test_the_tag_and_labels_name_the_version() -> None:
    assert gateway_tag() == f"kernelhub/gateway:{__version__}"
    assert gateway_tag("9.9") == "kernelhub/gateway:9.9"
    assert gateway_labels("9.9") == {
        LABEL_ROLE: "gateway",
        LABEL_MANAGED: "true",
        LABEL_VERSION: "9.9",
    }


def test_pip_wheel_builds_only_kernelhub_into_the_given_directory() -> None:
    argv = pip_wheel_command(Path("/src/kernelhub"), Path("/tmp/w"), python="/py")
    assert argv[:4] == ["/py", "-m", "pip", "wheel"]
    assert "--no-deps" in argv
    assert argv[argv.index("--wheel-dir") + 1] == "/tmp/w"
    assert argv[-1] == "/src/kernelhub"
    assert not {"--index-url", "-i", "--extra-index-url"} & set(argv)


def test_kernelhub_wheel_is_picked_with_its_version() -> None:
    assert kernelhub_wheel(["kernelhub-0.1.0-py3-none-any.whl"]) == (
        "kernelhub-0.1.0-py3-none-any.whl",
        "0.1.0",
    )
    assert kernelhub_wheel(["build.log", "kernelhub-1.2.3.dev4-py3-none-any.whl"])[1] == (
        "1.2.3.dev4"
    )


@pytest.mark.parametrize(
    "names",
    [
        [],
        ["kernelhub-0.1.0.tar.gz"],
        ["kernelhub_client-0.1.0-py3-none-any.whl"],
        ["kernelhub-0.1.0-py3-none-any.whl", "kernelhub-0.2.0-py3-none-any.whl"],
    ],
)
def test_kernelhub_wheel_refuses_anything_but_exactly_one(names: list[str]) -> None:
    with pytest.raises(ImageBuildError, match="expected one kernelhub-<version>"):
        kernelhub_wheel(names)


def make_checkout(root: Path, *, name: str = "kernelhub", dockerfile: bool = True) -> Path:
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0.1.0"\n')
    if dockerfile:
        (root / GATEWAY_IMAGE_DIR).mkdir()
        (root / GATEWAY_IMAGE_DIR / "Dockerfile").write_text("FROM scratch\n")
    return root


def test_the_source_checkout_is_the_first_kernelhub_project_with_a_gateway_dockerfile(
    tmp_path: Path,
) -> None:
    other = make_checkout(tmp_path / "other", name="not-kernelhub")
    bare = make_checkout(tmp_path / "bare", dockerfile=False)
    good = make_checkout(tmp_path / "good")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "pyproject.toml").write_text("[project\n")
    candidates = [tmp_path / "missing", tmp_path / "broken", other, bare, good]
    assert find_source_checkout(candidates) == good


def test_without_a_source_checkout_the_error_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError, match=r"source checkout.*looked in .*/nothing-here"):
        find_source_checkout([tmp_path / "nothing-here"])


def test_the_real_checkout_is_found() -> None:
    assert (REPO / "pyproject.toml").is_file()
    assert (SOURCES / "Dockerfile").is_file() and (SOURCES / "requirements.txt").is_file()


def test_build_context_holds_dockerfile_lock_and_wheels_owned_by_root(tmp_path: Path) -> None:
    sources = tmp_path / GATEWAY_IMAGE_DIR
    sources.mkdir()
    (sources / "Dockerfile").write_text("FROM scratch\n")
    (sources / "requirements.txt").write_text("dill==0.4.1\n")
    (sources / "requirements.txt").chmod(0o600)  # a restrictive umask
    (sources / "notes.txt").write_text("not part of the context")
    dep = tmp_path / "dill-0.4.1-py3-none-any.whl"
    own = tmp_path / "kernelhub-0.1.0-py3-none-any.whl"
    dep.write_bytes(b"PK")
    own.write_bytes(b"PK")

    buffer = io.BytesIO()
    write_gateway_context(buffer, sources, [dep], own)
    buffer.seek(0)
    with tarfile.open(fileobj=buffer) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == [
        "Dockerfile",
        "dist",
        "dist/kernelhub-0.1.0-py3-none-any.whl",
        "requirements.txt",
        "wheels",
        "wheels/dill-0.4.1-py3-none-any.whl",
    ]
    assert all(m.uid == 0 and m.gid == 0 and not m.uname for m in members.values())
    assert stat.S_IMODE(members["requirements.txt"].mode) == 0o644
    assert stat.S_IMODE(members["wheels"].mode) == 0o755
    assert stat.S_IMODE(members["dist"].mode) == 0o755


def test_build_context_refuses_missing_sources(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    with pytest.raises(ImageBuildError, match=r"requirements\.txt is missing"):
        write_gateway_context(io.BytesIO(), tmp_path, [], tmp_path / "kernelhub.whl")


# ---------------------------------------------------------------------------- Dockerfile


def instructions() -> list[tuple[str, str]]:
    text = (SOURCES / "Dockerfile").read_text().replace("\\\n", " ")
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last_from:]


def test_dockerfile_installs_offline_and_checks_the_result() -> None:
    body = " ".join(rest for keyword, rest in instructions() if keyword == "RUN")
    installs = re.findall(r"pip install[^;]*", body)
    assert installs and all("--no-index" in cmd for cmd in installs)
    assert '"kernelhub[server,postgres]==${KERNELHUB_VERSION}"' in body
    assert "pip check" in body
    assert instructions()[0] == ("ARG", "BASE=kernelhub/base:bookworm")
    # Only the final stage ships; the wheels never reach it.
    assert not any(
        k == "COPY" and ("wheels" in rest or "dist" in rest) for k, rest in final_stage()
    )


def test_dockerfile_labels_and_runs_the_gateway() -> None:
    stage = final_stage()
    assert stage[1] == ("LABEL", f"{LABEL_ROLE}=gateway {LABEL_MANAGED}=true")
    last = {keyword: rest for keyword, rest in stage}
    assert json.loads(last["ENTRYPOINT"]) == ["kernelhub"]
    assert json.loads(last["CMD"]) == ["serve"]
    assert last["EXPOSE"] == str(GatewaySettings().port)
    health = last["HEALTHCHECK"]
    assert f"{GATEWAY_VENV}/bin/python" in health and "/healthz" in health
    assert "curl" not in health


def test_dockerfile_keeps_the_loopback_default_and_points_at_the_mounts() -> None:
    env: dict[str, str] = {}
    for keyword, rest in final_stage():
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in rest.split())
    assert env["PATH"].split(":")[0] == f"{GATEWAY_VENV}/bin"
    assert "" not in env["PATH"].split(":")
    assert env["KERNELHUB_BACKEND"] == "docker"
    assert env["KERNELHUB_RUN_DIR"] == "/run/kernelhub"
    # Listening beyond loopback is the deployment's decision (compose.yaml), not the image's.
    assert "KERNELHUB_GATEWAY__HOST" not in env


# ---------------------------------------------------------------------------- lock


def lock() -> dict[str, str]:
    pins = locked_requirements((SOURCES / "requirements.txt").read_text())
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9.-]*==[0-9][0-9A-Za-z.+!-]*", p) for p in pins)
    names = [p.split("==")[0] for p in pins]
    assert len(names) == len(set(names)), "a package is pinned twice"
    return dict(p.split("==") for p in pins)


def roots() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    lines = [*project["dependencies"], *extras["server"], *extras["postgres"]]
    return [Requirement(line.split("#")[0].strip()) for line in lines]


def applies(requirement: Requirement, extras: frozenset[str]) -> bool:
    if requirement.marker is None:
        return True
    marker: Marker = requirement.marker
    return any(marker.evaluate({**TARGET_MARKERS, "extra": e}) for e in {"", *extras})


def test_the_lock_pins_every_root_within_its_range() -> None:
    pins = lock()
    for root in roots():
        name = canonicalize_name(root.name)
        assert name in pins, f"{root} (pyproject.toml) is not in gateway-image/requirements.txt"
        assert Version(pins[name]) in root.specifier, f"{name}=={pins[name]} violates {root}"
    assert "kernelhub" not in pins  # installed from the wheel built from the checkout


def test_the_lock_is_closed_over_the_installed_distributions() -> None:
    """Where this environment has a locked version installed, everything that version
    needs on the image's platform is locked too (the offline install would fail)."""
    pins = lock()
    todo = [(canonicalize_name(r.name), frozenset(r.extras)) for r in roots()]
    seen: set[tuple[str, frozenset[str]]] = set()
    checked = 0
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if canonicalize_name(dist.version) != canonicalize_name(pins.get(name, "")):
            continue  # another version here: its requirements say nothing about the pin
        checked += 1
        for line in dist.requires or []:
            requirement = Requirement(line)
            if not applies(requirement, extras):
                continue
            dep = canonicalize_name(requirement.name)
            assert dep in pins, f"{name}=={pins[name]} needs {requirement}, which is not locked"
            assert Version(pins[dep]) in requirement.specifier or not requirement.specifier, (
                f"{name}=={pins[name]} needs {requirement}; the lock has {dep}=={pins[dep]}"
            )
            todo.append((dep, frozenset(requirement.extras)))
    assert checked > 0


# ---------------------------------------------------------------------------- compose.yaml


def compose() -> dict[str, Any]:
    parsed = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert isinstance(parsed, dict)
    return parsed


def test_compose_runs_this_versions_gateway_image_without_building_it() -> None:
    gateway = compose()["services"]["gateway"]
    assert gateway["image"] == gateway_tag()
    assert "build" not in gateway  # the context needs wheels from the host


def test_compose_publishes_on_loopback_and_mounts_the_run_dir_at_the_same_path() -> None:
    gateway = compose()["services"]["gateway"]
    ports = published_ports(gateway)
    assert [(p.host_ip, p.published, p.target) for p in ports] == [("127.0.0.1", "8765", "8765")]
    env = environment(gateway)
    assert env["KERNELHUB_GATEWAY__HOST"] == "0.0.0.0"
    mounts = {v.target: v for v in volumes(gateway)}
    run_dir = env["KERNELHUB_RUN_DIR"]
    assert mounts[run_dir] == Volume(run_dir, run_dir, False)
    assert len(run_dir) <= 70  # the settings' limit for unix socket paths
    assert mounts["/var/run/docker.sock"].source == "/var/run/docker.sock"
    assert mounts["/sys/fs/cgroup"].read_only
    assert env["KERNELHUB_DATA_DIR"] in mounts


def test_compose_keeps_the_gateway_container_tight() -> None:
    gateway = compose()["services"]["gateway"]
    assert gateway["init"] is True
    assert gateway["read_only"] is True
    assert gateway["cap_drop"] == ["ALL"]
    assert set(gateway["cap_add"]) == {"CHOWN", "DAC_OVERRIDE"}
    assert "no-new-privileges:true" in gateway["security_opt"]
    assert gateway["stop_grace_period"] and gateway["restart"]
