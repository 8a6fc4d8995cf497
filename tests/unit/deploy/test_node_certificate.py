"""The certificate plan of deploy/kubernetes, with the cluster's own pieces: one node
leaf from ``kernelhub cluster certs`` whose SAN is the wildcard of the agents' pod names
under the headless Service, and the gateway replicas' real TLS client
(``kernelhub.cluster.proxy.client_context``), which checks the name it dials. A pod's name
is accepted; anything outside the Service's domain is not. Over a socketpair: no network."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

import pytest

from kernelhub.cluster import certs, proxy
from kernelhub.config import load_settings
from tests.unit.deploy.test_kubernetes import FIELD_VALUES, NODE, of_kind, the


def service_domain() -> str:
    daemonset, pod = the(NODE)
    [headless] = [s for s in of_kind("Service") if s["spec"]["selector"] == NODE]
    assert pod["subdomain"] == headless["metadata"]["name"]
    return f"{pod['subdomain']}.{daemonset['metadata']['namespace']}.svc.cluster.local"


def handshake(out: Path, server_name: str) -> None:
    """A TLS handshake: the node agent's side as ``kernelhub node`` serves (its leaf, a
    client certificate of the CA required), the replica's as it dials ``server_name``."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(out / "node-kube.pem", out / "node-kube.key")
    server.load_verify_locations(out / "ca.pem")
    server.verify_mode = ssl.CERT_REQUIRED
    settings = load_settings(
        cluster={
            "ca_file": out / "ca.pem",
            "cert_file": out / "gateway-kube.pem",
            "key_file": out / "gateway-kube.key",
        }
    )
    client = proxy.client_context(settings)
    a, b = socket.socketpair()
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(b, server_side=True) as tls:
                tls.recv(1)
        except (ssl.SSLError, OSError) as exc:
            failure.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(a, server_hostname=server_name) as tls:
            tls.sendall(b"x")
    finally:
        thread.join(10)
    assert not failure, failure


def test_one_wildcard_leaf_serves_every_agent_pod_and_nothing_else(tmp_path: Path) -> None:
    domain = service_domain()
    certs.make_certs(tmp_path, ["kube"], ["kube"], [f"*.{domain}"])
    handshake(tmp_path, f"{FIELD_VALUES['metadata.name']}.{domain}")
    handshake(tmp_path, f"kernelhub-node-q9w4z.{domain}")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(tmp_path, f"kernelhub-node-q9w4z.other.{domain}")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(tmp_path, "postgres.example.internal")
