"""deploy/systemd/ as systemd reads it: ``systemd-analyze verify`` accepts the units with
no warning (an unknown or misspelt directive is only a warning to systemd, so any output
fails here), they run the cluster commands with variables that name real settings and
load, and their hardening is what each role allows: the node agent root with two
capabilities beside Docker, the gateway replica nobody with none."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import UNIT
from tests.unit.deploy.settings_env import check_command, load_with, setting

SYSTEMD = Path(__file__).resolve().parents[3] / "deploy" / "systemd"
UNITS = ["kernelhub-node.service", "kernelhub-gateway.service", "run-kernelhub.mount"]
INSTALLED = "/opt/kernelhub/bin/kernelhub"


def parse(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections: (key, value) in order, repeated keys kept."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        assert not line.endswith("\\"), "no continuation lines: keep them greppable"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not KEY=VALUE"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: str, section: str, key: str) -> list[str]:
    return [v for k, v in parse(SYSTEMD / unit)[section] if k == key]


def one(unit: str, key: str, section: str = "Service") -> str:
    [value] = values(unit, section, key)
    return value


def environment(unit: str) -> dict[str, str]:
    """What the service's process sees: its EnvironmentFile= (the example beside it),
    then Environment=, with %d (the credentials directory) expanded."""
    [env_file] = values(unit, "Service", "EnvironmentFile")
    example = SYSTEMD / (Path(env_file).stem + ".env.example")
    env = {}
    for line in example.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    for value in values(unit, "Service", "Environment"):
        key, _, value = value.partition("=")
        env[key] = value.replace("%d", f"/run/credentials/{unit}")
    return env


def test_systemd_analyze_verify_accepts_the_units_without_a_word(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: systemd)")
    kernelhub = Path(sys.executable).parent / "kernelhub"
    assert kernelhub.exists(), "verify checks that ExecStart's program exists"
    for unit in UNITS:
        text = (SYSTEMD / unit).read_text().replace(INSTALLED, str(kernelhub))
        (tmp_path / unit).write_text(text)
    result = subprocess.run(
        [analyze, "verify", *(str(tmp_path / u) for u in UNITS)],
        capture_output=True, text=True, timeout=60 * UNIT,
    )  # fmt: skip
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "kernelhub" in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def test_verify_would_catch_a_misspelt_directive(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: systemd)")
    unit = tmp_path / "kernelhub-typo.service"
    unit.write_text(f"[Service]\nExecStart={sys.executable} -V\nProtectSystm=strict\n")
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60 * UNIT
    )
    assert "ProtectSystm" in result.stderr


SERVICES = [("kernelhub-node.service", "node"), ("kernelhub-gateway.service", "gateway")]


@pytest.mark.parametrize(("unit", "command"), SERVICES)
def test_the_services_variables_name_settings_that_load(
    unit: str, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = one(unit, "ExecStart").split()
    assert argv[0] == INSTALLED and argv[1] == command
    env = environment(unit)
    for name in env:
        setting(name)
    settings = load_with(env, monkeypatch)
    assert settings.gateway.host == "0.0.0.0"
    assert settings.cluster.ca_file is not None and settings.store.url is not None
    # The state directory systemd makes is the one kernelhub is told to use.
    assert str(settings.data_dir) == f"/var/lib/{one(unit, 'StateDirectory')}"
    if command == "node":
        assert settings.gateway.hibernate_standby is False, "10,000 idle standbys"


def test_the_services_commands_exist() -> None:
    for unit, command in SERVICES:
        assert one(unit, "ExecStart").split()[1] == command
        check_command(command)


def test_the_node_agent_is_root_with_two_capabilities_and_needs_docker_and_the_tmpfs() -> None:
    unit = "kernelhub-node.service"
    assert one(unit, "User") == "root"
    assert set(one(unit, "CapabilityBoundingSet").split()) == {"CAP_CHOWN", "CAP_DAC_OVERRIDE"}
    for directive in ("Requires", "After"):
        assert {"docker.service", "run-kernelhub.mount"} <= set(
            one(unit, directive, "Unit").split()
        )
    run_dir = environment(unit)["KERNELHUB_RUN_DIR"]
    assert one("run-kernelhub.mount", "Where", "Mount") == run_dir
    assert re.search(r"(^|,)size=\d+[km](,|$)", one("run-kernelhub.mount", "Options", "Mount"))
    assert one(unit, "ReadWritePaths") == run_dir
    assert one(unit, "ProtectSystem") == "strict" and one(unit, "NoNewPrivileges") == "yes"


def test_the_gateway_replica_is_a_dynamic_user_without_any_capability() -> None:
    unit = "kernelhub-gateway.service"
    assert one(unit, "DynamicUser") == "yes"
    assert one(unit, "CapabilityBoundingSet") == "" and one(unit, "AmbientCapabilities") == ""
    assert "User" not in dict(parse(SYSTEMD / unit)["Service"])
    for key, want in (("ProtectSystem", "strict"), ("NoNewPrivileges", "yes"),
                      ("PrivateTmp", "yes"), ("PrivateDevices", "yes"),
                      ("ProtectHome", "yes"), ("PrivateUsers", "yes")):  # fmt: skip
        assert one(unit, key) == want, key
    assert "docker" not in (SYSTEMD / unit).read_text().split("[Unit]")[1].split("[Service]")[0]
