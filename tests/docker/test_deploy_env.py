"""The Kubernetes manifests' environment, run for real: a node agent and a gateway replica
started with exactly the variables deploy/kubernetes sets (Secrets from the example,
downward-API fields), less only what a test must change (paths, ports, loopback, the TLS
files it makes and the store it starts), serve a session end to end; and the node agents'
exec probe (the ConfigMap's script) passes against the real agent over mutual TLS. Object
storage is left out here (the example's endpoint is no server); the multinode tier runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kernelhub.client import Hub
from tests import postgres
from tests.conftest import RUN_INSTANCE, UNIT
from tests.egress_net import make_ca
from tests.gateway.conftest import free_port, gateway_run_dir, remove_sandboxes, wait_until_up
from tests.unit.deploy.settings_env import check_command
from tests.unit.deploy.test_kubernetes import GATEWAY, NODE, resolved_env, the

pytestmark = [pytest.mark.docker, pytest.mark.postgres]
NODE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "node.yaml"


def manifest_env(component: dict[str, str], overrides: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it, with ``overrides`` replacing
    variables the manifest sets (never adding one: what it lacks, the test must not
    supply)."""
    workload, pod = the(component)
    env = resolved_env(workload, pod["containers"][0])
    added = set(overrides) - set(env) - {"KERNELHUB_POOL__SIZE"}
    assert not added, f"the manifest does not set {sorted(added)}"
    kept = {k: v for k, v in env.items() if not k.startswith("KERNELHUB_OBJECTS__")}
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERNELHUB_")}
    return {**base, **kept, **overrides}


def probe(env: dict[str, str], path: str, tmp_path: Path) -> int:
    [config] = [
        d for d in yaml.safe_load_all(NODE_YAML.read_text()) if d and d["kind"] == "ConfigMap"
    ]
    script = tmp_path / "probe.py"
    script.write_text(config["data"]["probe.py"])
    return subprocess.run(
        [sys.executable, str(script), path], env=env, capture_output=True, timeout=30 * UNIT
    ).returncode


def test_the_manifests_environment_serves_a_session(
    tmp_path: Path, postgres_cluster: postgres.PostgresCluster
) -> None:
    check_command("node")
    check_command("gateway")
    ca = make_ca(tmp_path / "ca")
    leaf = ca.issue(tmp_path, ["localhost"])  # certificate and key in one PEM
    key = tmp_path / "snapshot.key"
    key.write_bytes(os.urandom(32))
    store = postgres_cluster.fresh_url()
    node_port, replica_port = free_port(), free_port()
    instance = f"{RUN_INSTANCE}k"
    tls = {
        "KERNELHUB_CLUSTER__CA_FILE": str(ca.cert_file),
        "KERNELHUB_CLUSTER__CERT_FILE": str(leaf),
        "KERNELHUB_CLUSTER__KEY_FILE": str(leaf),
        "KERNELHUB_STORE__URL": store,
        "KERNELHUB_GATEWAY__HOST": "127.0.0.1",
    }
    node_env = manifest_env(NODE, {
        **tls,
        "KERNELHUB_GATEWAY__PORT": str(node_port),
        "KERNELHUB_CLUSTER__ADDRESS": f"https://localhost:{node_port}",
        "KERNELHUB_CLUSTER__SNAPSHOT_KEY_FILE": str(key),
        "KERNELHUB_GATEWAY__INSTANCE": instance,
        "KERNELHUB_DATA_DIR": str(tmp_path / "node"),
        "KERNELHUB_RUN_DIR": str(gateway_run_dir() / instance),
        "KERNELHUB_POOL__SIZE": "0",
    })  # fmt: skip
    replica_env = manifest_env(GATEWAY, {
        **tls,
        "KERNELHUB_GATEWAY__PORT": str(replica_port),
        "KERNELHUB_DATA_DIR": str(tmp_path / "replica"),
        "KERNELHUB_RUN_DIR": str(gateway_run_dir() / f"{instance}r"),
    })  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        node_log = tmp_path / "node.log"
        with node_log.open("wb") as sink:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kernelhub.cli", "node", "--no-build"],
                env=node_env, stdout=sink, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        deadline = time.monotonic() + 90 * UNIT
        while probe(node_env, "/readyz", tmp_path) != 0:
            assert procs[0].poll() is None, node_log.read_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"the probe never passed: {node_log.read_text()[-3000:]}"
            )
            time.sleep(0.2)
        assert probe(node_env, "/healthz", tmp_path) == 0
        replica_log = tmp_path / "replica.log"
        with replica_log.open("wb") as sink:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kernelhub.cli", "gateway"],
                env=replica_env, stdout=sink, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        url = f"http://127.0.0.1:{replica_port}"
        wait_until_up(procs[1], f"{url}/readyz", replica_log)
        token = subprocess.run(
            [sys.executable, "-m", "kernelhub.cli", "token", "create", "--name", "deploy", "--admin"],
            env=replica_env, capture_output=True, text=True, check=True, timeout=60 * UNIT,
        ).stdout.strip()  # fmt: skip
        with Hub(url, token, timeout=120 * UNIT) as hub, hub.create_session() as session:
            assert session.run("print(6 * 7)").stdout == "42\n"
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        # A stopped agent leaves its sandboxes (and their mounts) for re-adoption, on
        # purpose; the reaper removes them as it would on a machine.
        subprocess.run(
            [sys.executable, "-m", "kernelhub.cli", "reap"],
            env=node_env, capture_output=True, timeout=120 * UNIT,
        )  # fmt: skip
        remove_sandboxes(instance)
