"""deploy/kubernetes/ read as Kubernetes would: every manifest valid against the bundled
JSON schemas of current Kubernetes releases (strict: an unknown or misspelt field fails),
and the deployment's promises checked as data: probes, requests and limits on every
container, the gateways' and node agents' privileges, NetworkPolicies that let through
exactly the traffic the design needs, pinned images, and ``KERNELHUB_*`` variables that
name real settings and load. No cluster runs them here (none can on these machines)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kernelhub.image.gateway import GATEWAY_VENV, gateway_tag
from tests.unit.deploy.netpol import Endpoint, reachable
from tests.unit.deploy.settings_env import check_command, load_with, setting

REPO = Path(__file__).resolve().parents[3]
KUBE = REPO / "deploy" / "kubernetes"
EXAMPLE_SECRETS = KUBE / "secrets.example.yaml"
# The releases still supported when this was written, oldest first; kubernetes-validate
# bundles their schemas (1.25 to 1.37 in 1.37.0). Bump with the pin in pyproject.toml.
KUBERNETES_VERSIONS = ["1.35.0", "1.36.0", "1.37.0"]
GATEWAY = {"app.kubernetes.io/name": "kernelhub", "app.kubernetes.io/component": "gateway"}
NODE = {"app.kubernetes.io/name": "kernelhub", "app.kubernetes.io/component": "node"}
GATEWAY_PORT, NODE_PORT = 8765, 8766
# What the downward API gives, for loading the settings as a pod would.
FIELD_VALUES = {"metadata.name": "kernelhub-node-x7k2p", "spec.nodeName": "worker-1",
                "status.podIP": "10.1.2.3", "metadata.namespace": "kernelhub-nodes"}  # fmt: skip


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomized() -> list[Path]:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    return [KUBE / name for name in kustomization["resources"]]


MANIFESTS = [doc for path in kustomized() for doc in load(path)]
SECRETS = load(EXAMPLE_SECRETS)


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in MANIFESTS if doc["kind"] == kind]


def workloads() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template spec) for every Deployment, DaemonSet and StatefulSet."""
    for doc in MANIFESTS:
        if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            yield doc, doc["spec"]["template"]["spec"]


def the(component: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    [found] = [
        (w, pod)
        for w, pod in workloads()
        if w["spec"]["template"]["metadata"]["labels"] == component
    ]
    return found


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def resolved_env(workload: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: Secret keys from
    secrets.example.yaml, downward-API fields, ``$(VAR)`` of earlier variables."""
    namespace = workload["metadata"]["namespace"]
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            value = secret(namespace, ref["name"])[ref["key"]]
        else:
            value = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
        env[var["name"]] = value
    return env


def secret(namespace: str, name: str) -> dict[str, str]:
    found = [s for s in SECRETS if s["metadata"] == {"name": name, "namespace": namespace}]
    assert found, f"secrets.example.yaml has no Secret {namespace}/{name}"
    data: dict[str, str] = found[0]["stringData"]
    return data


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas_strictly(version: str) -> None:
    documents = [*MANIFESTS, *SECRETS]
    assert len(documents) >= 15
    for doc in documents:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{name} is invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}"
            )


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The validator would let nothing through if it read these loosely."""
    _, pod = the(GATEWAY)
    broken = {**the(GATEWAY)[0]}
    broken["spec"] = {**broken["spec"], "template": {"spec": {**pod, "securtyContext": {}}}}
    with pytest.raises(kubernetes_validate.ValidationError, match="securtyContext"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest_but_the_example_secrets() -> None:
    on_disk = {p for p in KUBE.glob("*.yaml")} - {KUBE / "kustomization.yaml", EXAMPLE_SECRETS}
    assert set(kustomized()) == on_disk
    assert all(doc["kind"] == "Secret" for doc in SECRETS), "real Secrets never ship"
    assert not of_kind("Secret"), "a Secret in the base would overwrite the operator's"


def test_everything_is_in_the_kernelhub_namespaces() -> None:
    namespaces = {doc["metadata"]["name"] for doc in of_kind("Namespace")}
    assert namespaces == {"kernelhub", "kernelhub-nodes"}
    for doc in MANIFESTS:
        if doc["kind"] not in ("Namespace",):
            assert doc["metadata"]["namespace"] in namespaces, doc["metadata"]


# --------------------------------------------------------------------------- every container


def test_every_container_has_readiness_and_liveness_probes_on_readyz_and_healthz() -> None:
    for workload, pod in workloads():
        for container in pod["containers"]:
            where = f"{workload['metadata']['name']}/{container['name']}"
            for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
                spec = container.get(probe)
                assert spec, f"{where} has no {probe}"
                asked = (
                    spec["httpGet"]["path"] if "httpGet" in spec else spec["exec"]["command"][-1]
                )
                assert asked == path, f"{where}: {probe} asks {asked}, not {path}"


def test_every_container_has_cpu_and_memory_requests_and_limits() -> None:
    for workload, pod in workloads():
        for container in containers(pod):
            resources = container.get("resources", {})
            where = f"{workload['metadata']['name']}/{container['name']}"
            for kind in ("requests", "limits"):
                assert set(resources.get(kind, {})) >= {"cpu", "memory"}, f"{where}: {kind}"
            for resource in ("cpu", "memory"):
                request = quantity(resources["requests"][resource])
                assert request <= quantity(resources["limits"][resource]), f"{where} {resource}"


def quantity(value: str | int) -> float:
    """A Kubernetes quantity as a number (the suffixes the manifests use)."""
    text = str(value)
    for suffix, factor in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10), ("m", 1e-3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def test_images_are_pinned_to_the_release_the_image_builder_tags() -> None:
    for workload, pod in workloads():
        for container in containers(pod):
            image = container["image"]
            name, _, tag = image.rpartition(":")
            assert name and tag and tag != "latest", f"{workload['metadata']['name']}: {image}"
            if name == "kernelhub/gateway":
                assert image == gateway_tag(), "`kernelhub image build-gateway` tags another"


def test_every_kernelhub_variable_names_a_setting_and_the_values_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for workload, pod in workloads():
        for container in containers(pod):
            env = resolved_env(workload, container)
            named = [n for n in env if n.startswith("KERNELHUB_")]
            assert named, container["name"]
            for name in named:
                setting(name)
            with monkeypatch.context() as m:
                settings = load_with(env, m)
            if container["args"][0] == "node":
                assert settings.gateway.hibernate_standby is False, "10,000 idle standbys"


def test_a_renamed_setting_would_fail_the_check() -> None:
    with pytest.raises(AssertionError, match="no field 'prot'"):
        setting("KERNELHUB_GATEWAY__PROT")
    with pytest.raises(AssertionError, match="no field 'nodes'"):
        setting("KERNELHUB_STORE__NODES")
    assert setting("KERNELHUB_CLUSTER__SNAPSHOT_KEY_FILE").annotation is not None


def test_the_commands_exist() -> None:
    for _, pod in workloads():
        for container in pod["containers"]:
            check_command(container["args"][0])


def test_exec_probes_run_the_images_python_on_the_mounted_script() -> None:
    for workload, pod in workloads():
        for container in pod["containers"]:
            mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
            scripts = {
                f"{mounts[v['name']]}/{key}"
                for v in pod.get("volumes", [])
                if "configMap" in v and v["name"] in mounts
                for config in of_kind("ConfigMap")
                if config["metadata"]["name"] == v["configMap"]["name"]
                for key in config["data"]
            }
            for probe in ("readinessProbe", "livenessProbe"):
                if "exec" in container[probe]:
                    python, script, _ = container[probe]["exec"]["command"]
                    assert python == f"{GATEWAY_VENV}/bin/python", workload["metadata"]["name"]
                    assert script in scripts, f"{script} is not a mounted ConfigMap key"


def test_every_secret_and_config_map_a_pod_mounts_exists() -> None:
    maps = {(c["metadata"]["namespace"], c["metadata"]["name"]) for c in of_kind("ConfigMap")}
    for workload, pod in workloads():
        namespace = workload["metadata"]["namespace"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                secret(namespace, volume["secret"]["secretName"])
            if "configMap" in volume:
                assert (namespace, volume["configMap"]["name"]) in maps, volume


# --------------------------------------------------------------------------- gateways


def test_gateways_are_two_or_more_behind_a_service_and_a_disruption_budget() -> None:
    deployment, pod = the(GATEWAY)
    assert deployment["kind"] == "Deployment" and deployment["spec"]["replicas"] >= 2
    [service] = [s for s in of_kind("Service") if s["spec"]["selector"] == GATEWAY]
    [port] = service["spec"]["ports"]
    named = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
    assert named[port["targetPort"]] == GATEWAY_PORT
    [budget] = of_kind("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"] == GATEWAY
    assert 1 <= budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def test_gateways_are_non_root_read_only_and_without_any_capability() -> None:
    _, pod = the(GATEWAY)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert not {"hostNetwork", "hostPID", "hostIPC"} & {k for k, v in pod.items() if v}
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    for container in containers(pod):
        ctx = container["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx.get("privileged", False) is False
        assert ctx["capabilities"] == {"drop": ["ALL"]}


# --------------------------------------------------------------------------- node agents


def test_node_agents_get_the_docker_socket_and_the_run_dir_and_nothing_more() -> None:
    daemonset, pod = the(NODE)
    assert daemonset["kind"] == "DaemonSet"
    assert not {"hostNetwork", "hostPID", "hostIPC"} & {k for k, v in pod.items() if v}
    assert pod["automountServiceAccountToken"] is False
    [container] = pod["containers"]
    ctx = container["securityContext"]
    assert ctx.get("privileged", False) is False
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert set(ctx["capabilities"]["add"]) <= {"CHOWN", "DAC_OVERRIDE"}
    host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    run_dir = resolved_env(daemonset, container)["KERNELHUB_RUN_DIR"]
    assert sorted(h["path"] for h in host_paths.values()) == sorted(
        ["/var/run/docker.sock", run_dir, "/var/lib/kernelhub"]
    )
    assert {h["path"]: h["type"] for h in host_paths.values()}["/var/run/docker.sock"] == "Socket"
    # Never created by the kubelet: without the host's tmpfs mount, no pod.
    assert {h["path"]: h["type"] for h in host_paths.values()}[run_dir] == "Directory"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for name, host in host_paths.items():
        # The daemon resolves the sandboxes' bind sources on the host: identical paths.
        assert mounts[name] == host["path"], name


def test_node_agents_advertise_their_pod_name_and_read_certs_and_keys_from_secrets() -> None:
    daemonset, pod = the(NODE)
    [container] = pod["containers"]
    env = resolved_env(daemonset, container)
    pod_name = FIELD_VALUES["metadata.name"]
    [headless] = [s for s in of_kind("Service") if s["spec"]["selector"] == NODE]
    assert (
        headless["spec"]["clusterIP"] == "None" and pod["subdomain"] == headless["metadata"]["name"]
    )
    host = f"{pod_name}.{pod['subdomain']}.{daemonset['metadata']['namespace']}.svc.cluster.local"
    assert env["KERNELHUB_CLUSTER__ADDRESS"] == f"https://{host}:{NODE_PORT}"
    assert env["KERNELHUB_STORE__NODE"] == FIELD_VALUES["spec.nodeName"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    secret_volumes = {v["name"] for v in pod["volumes"] if "secret" in v}
    for var in ("CA_FILE", "CERT_FILE", "KEY_FILE", "SNAPSHOT_KEY_FILE"):
        path = Path(env[f"KERNELHUB_CLUSTER__{var}"])
        assert mounts[str(path.parent)] in secret_volumes, var
    for var in ("KERNELHUB_STORE__URL", "KERNELHUB_OBJECTS__SECRET_ACCESS_KEY"):
        [entry] = [e for e in container["env"] if e["name"] == var]
        assert "secretKeyRef" in entry["valueFrom"], f"{var} must come from a Secret"


# --------------------------------------------------------------------------- network


POLICIES = of_kind("NetworkPolicy")
CLIENT = Endpoint("default", {"app": "chat-backend"}, "10.244.1.9")
GATEWAY_POD = Endpoint("kernelhub", GATEWAY, "10.244.2.4")
NODE_POD = Endpoint("kernelhub-nodes", NODE, "10.244.3.5")
STRANGER_IN_NODES = Endpoint("kernelhub-nodes", {"app": "debug"}, "10.244.3.6")
POSTGRES = Endpoint(ip="192.0.2.10")
S3 = Endpoint(ip="192.0.2.20")
INTERNET = Endpoint(ip="198.51.100.7")


def allowed(source: Endpoint, destination: Endpoint, port: int) -> bool:
    return reachable(POLICIES, source, destination, port)


def test_network_policies_let_through_exactly_what_the_design_needs() -> None:
    expected = [
        (CLIENT, GATEWAY_POD, GATEWAY_PORT, True),  # clients -> gateways
        (CLIENT, GATEWAY_POD, 9090, False),  # ... their API port only
        (CLIENT, NODE_POD, NODE_PORT, False),  # ... and not the node agents
        (GATEWAY_POD, NODE_POD, NODE_PORT, True),  # gateways -> node agents' port
        (GATEWAY_POD, NODE_POD, 22, False),  # ... that port only
        (GATEWAY_POD, POSTGRES, 5432, True),
        (GATEWAY_POD, S3, 443, False),
        (GATEWAY_POD, INTERNET, 443, False),
        (NODE_POD, POSTGRES, 5432, True),  # node agents -> Postgres and S3
        (NODE_POD, S3, 443, True),
        (NODE_POD, INTERNET, 443, False),
        (NODE_POD, GATEWAY_POD, GATEWAY_PORT, False),
        (NODE_POD, NODE_POD, NODE_PORT, False),  # agents do not talk to each other
        (STRANGER_IN_NODES, NODE_POD, NODE_PORT, False),
        (CLIENT, POSTGRES, 5432, True),  # not ours to police
    ]
    wrong = [(s, d, port, want) for s, d, port, want in expected if allowed(s, d, port) is not want]
    assert not wrong


def test_each_namespace_denies_by_default_and_each_role_has_its_policy() -> None:
    for namespace, role in (("kernelhub", GATEWAY), ("kernelhub-nodes", NODE)):
        mine = [p for p in POLICIES if p["metadata"]["namespace"] == namespace]
        deny = [
            p
            for p in mine
            if p["spec"]["podSelector"] == {}
            and not p["spec"].get("ingress")
            and not p["spec"].get("egress")
        ]
        assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        assert [p for p in mine if p["spec"]["podSelector"] == {"matchLabels": role}]


def test_the_evaluator_reads_policies_as_kubernetes_does() -> None:
    """No policy: everything through; a default deny: nothing; one rule: that port."""
    a, b = Endpoint("x", {"r": "a"}), Endpoint("x", {"r": "b"})
    assert reachable([], a, b, 80)
    deny = {"metadata": {"namespace": "x"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert not reachable([deny], a, b, 80)
    assert reachable([deny], b, Endpoint(ip="192.0.2.1"), 80), "ingress-only isolates no egress"
    allow = {"metadata": {"namespace": "x"}, "spec": {
        "podSelector": {"matchLabels": {"r": "b"}}, "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"r": "a"}}}], "ports": [{"port": 80}]}]}}  # fmt: skip
    assert reachable([deny, allow], a, b, 80)
    assert not reachable([deny, allow], a, b, 81)
    assert not reachable([deny, allow], Endpoint("y", {"r": "a"}), b, 80), "other namespace"
