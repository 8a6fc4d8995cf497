"""NetworkPolicy as Kubernetes reads it, for the tests: may traffic go from one endpoint to
another, given a set of policies? Pure, and only as much of the API as the manifests use
(matchLabels, namespace and pod selectors, ipBlock, numbered ports); anything else fails
loudly rather than being read wrongly."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

NAMESPACE_NAME = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Endpoint:
    """A pod (namespace, labels and its ip) or an address outside the cluster (ip only).
    An ipBlock matches pods by their address too: Kubernetes leaves it to the network
    plugin whether it does, so a security check must assume it may."""

    namespace: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    ip: str | None = None

    @property
    def is_pod(self) -> bool:
        return self.namespace is not None


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return True
    assert set(selector) <= {"matchLabels"}, f"unsupported selector {selector}"
    wanted = selector.get("matchLabels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def _peer_matches(peer: Mapping[str, Any], policy_ns: str, other: Endpoint) -> bool:
    assert set(peer) <= {"ipBlock", "namespaceSelector", "podSelector"}, peer
    if "ipBlock" in peer:
        if other.ip is None:
            return False
        address = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        inside = address in ipaddress.ip_network(block["cidr"])
        return inside and not any(
            address in ipaddress.ip_network(e) for e in block.get("except") or []
        )
    if not other.is_pod:
        return False
    if "namespaceSelector" in peer:
        assert other.namespace is not None
        if not _selects(peer["namespaceSelector"], {NAMESPACE_NAME: other.namespace}):
            return False
    elif other.namespace != policy_ns:
        return False
    return _selects(peer.get("podSelector"), other.labels)


def _port_matches(ports: list[Mapping[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for entry in ports:
        assert isinstance(entry.get("port"), int), f"named or missing port in {entry}"
        if entry["port"] == port and entry.get("protocol", "TCP") == protocol:
            return True
    return False


def _allowed(
    policies: Iterable[Mapping[str, Any]],
    direction: str,
    pod: Endpoint,
    other: Endpoint,
    port: int,
    protocol: str,
) -> bool:
    """Whether ``pod`` may receive from (Ingress) or send to (Egress) ``other``."""
    kind, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    isolating = [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and direction in p["spec"]["policyTypes"]
        and _selects(p["spec"]["podSelector"], pod.labels)
    ]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get(kind) or []:
            peers = rule.get(peers_key)
            ns = policy["metadata"]["namespace"]
            if (not peers or any(_peer_matches(p, ns, other) for p in peers)) and _port_matches(
                rule.get("ports"), port, protocol
            ):
                return True
    return False


def reachable(
    policies: Iterable[Mapping[str, Any]], source: Endpoint, destination: Endpoint, port: int
) -> bool:
    """Whether a TCP connection from ``source`` to ``destination:port`` gets through: the
    source's egress policies and the destination's ingress policies both allow it."""
    policies = list(policies)
    if source.is_pod and not _allowed(policies, "Egress", source, destination, port, "TCP"):
        return False
    return not destination.is_pod or _allowed(policies, "Ingress", destination, source, port, "TCP")
