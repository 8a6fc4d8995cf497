"""deploy/compose/cluster.yaml as Docker Compose resolves it (``docker-compose config``:
anchors merged, variables interpolated): Postgres and S3 reachable by the cluster only,
two node agents that do not step on each other on one Docker daemon, two replicas with
nothing of the host, ports on loopback only, and settings that name real fields and load.
Compose itself refuses to start without the secrets (``${VAR:?}``), which is checked too."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelhub.image.gateway import gateway_tag
from tests.conftest import UNIT
from tests.docker.test_compose import compose_command, environment, published_ports, volumes
from tests.unit.deploy.settings_env import load_with, setting

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "deploy" / "compose" / "cluster.yaml"
SECRETS = {
    "KERNELHUB_PG_PASSWORD": "pg-secret",
    "KERNELHUB_S3_ACCESS_KEY": "s3-id",
    "KERNELHUB_S3_SECRET_KEY": "s3-secret",
}
NODES, GATEWAYS = ("node-1", "node-2"), ("gateway-1", "gateway-2")
DOCKER_SOCKET = "/var/run/docker.sock"


def compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = compose_command()
    if command is None:
        reason = "docker-compose is not installed (`apt-get install -y docker-compose`)"
        if os.environ.get("KERNELHUB_REQUIRE_DOCKER") == "1":
            pytest.fail(f"KERNELHUB_REQUIRE_DOCKER=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return subprocess.run(
        [*command, "-f", str(CLUSTER), *args],
        cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=60 * UNIT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    result = compose("config", env=SECRETS)
    assert result.returncode == 0, result.stderr
    parsed = yaml.safe_load(result.stdout)
    assert isinstance(parsed, dict)
    return parsed


@pytest.fixture(scope="module")
def services(config: dict[str, Any]) -> dict[str, Any]:
    parsed: dict[str, Any] = config["services"]
    return parsed


def test_the_cluster_is_postgres_s3_two_nodes_and_two_gateways(services: dict[str, Any]) -> None:
    assert set(services) == {"postgres", "s3", *NODES, *GATEWAYS}
    for name in (*NODES, *GATEWAYS):
        assert services[name]["image"] == gateway_tag()
        assert services[name]["command"][0] == ("node" if name in NODES else "gateway")
    for name, service in services.items():
        assert not service["image"].endswith(":latest") and ":" in service["image"], name


def test_without_the_secrets_compose_refuses_to_start() -> None:
    result = compose("config", env={})
    assert result.returncode != 0
    assert "KERNELHUB_PG_PASSWORD" in result.stderr


def test_only_the_gateways_publish_and_only_on_loopback(services: dict[str, Any]) -> None:
    published = {name: published_ports(s) for name, s in services.items()}
    assert {n for n, p in published.items() if p} == set(GATEWAYS)
    for ports in published.values():
        assert all(p.host_ip == "127.0.0.1" for p in ports)
    assert sorted(p.published for n in GATEWAYS for p in published[n]) == ["8765", "8775"]


def test_postgres_s3_and_the_agents_are_on_internal_networks_only(
    config: dict[str, Any], services: dict[str, Any]
) -> None:
    internal = {n for n, net in config["networks"].items() if (net or {}).get("internal")}
    for name in ("postgres", "s3", *NODES):
        assert set(services[name]["networks"]) <= internal, name


def test_node_agents_on_one_daemon_keep_apart(services: dict[str, Any]) -> None:
    seen: dict[str, set[str]] = {"instance": set(), "node": set(), "run": set()}
    for name in NODES:
        service = services[name]
        env = environment(service)
        run_dir = env["KERNELHUB_RUN_DIR"]
        mounts = {v.target: v for v in volumes(service)}
        assert mounts[run_dir].source == run_dir, "sandboxes mount it by the host path"
        assert mounts[DOCKER_SOCKET].source == DOCKER_SOCKET
        assert env["KERNELHUB_CLUSTER__ADDRESS"] == f"https://{name}:8766"
        seen["instance"].add(env["KERNELHUB_GATEWAY__INSTANCE"])
        seen["node"].add(env["KERNELHUB_STORE__NODE"])
        seen["run"].add(run_dir)
        assert set(service["cap_add"]) <= {"CHOWN", "DAC_OVERRIDE"}
        assert service["cap_drop"] == ["ALL"] and service["read_only"] is True
        assert "no-new-privileges:true" in service["security_opt"]
    assert all(len(values) == len(NODES) for values in seen.values()), seen


def test_gateway_replicas_get_nothing_of_the_host(services: dict[str, Any]) -> None:
    for name in GATEWAYS:
        service = services[name]
        uid = service["user"].split(":")[0]
        assert uid not in ("0", "root")
        assert service["cap_drop"] == ["ALL"] and "cap_add" not in service
        assert service["read_only"] is True
        assert "no-new-privileges:true" in service["security_opt"]
        binds = [v for v in volumes(service) if v.is_bind]
        assert all(v.target == "/certs" and v.read_only for v in binds), binds


def test_every_kernelhub_variable_names_a_setting_and_the_values_load(
    services: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (*NODES, *GATEWAYS):
        env = environment(services[name])
        for variable in env:
            if variable.startswith("KERNELHUB_"):
                setting(variable)
        with monkeypatch.context() as m:
            settings = load_with(env, m)
        assert settings.store.url is not None
        assert settings.store.url.get_secret_value().endswith("@postgres:5432/kernelhub")
        if name in NODES:
            assert settings.gateway.hibernate_standby is False, "10,000 idle standbys"
