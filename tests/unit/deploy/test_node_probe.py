"""The node agents' probe (node.yaml's ConfigMap), run for real against a server that
does what a node agent does at the TLS layer: it requires a client certificate of the
cluster CA, so the kubelet's own httpGet probe (no certificate) could never pass. The
probe asks with the pod's certificate, exits 0 on 200 and non-zero otherwise."""

from __future__ import annotations

import contextlib
import http.server
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests import egress_net
from tests.conftest import UNIT
from tests.egress_net import make_ca

NODE_YAML = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes" / "node.yaml"


class _Agent(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status = {"/healthz": 200, "/readyz": 503}.get(self.path, 404)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def mutual_tls_server(ca: egress_net.TestCA, directory: Path) -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Agent)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(ca.issue(directory, ["kernelhub-node"]))
    context.load_verify_locations(cafile=str(ca.cert_file))
    context.verify_mode = ssl.CERT_REQUIRED
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    [config] = [
        d for d in yaml.safe_load_all(NODE_YAML.read_text()) if d and d["kind"] == "ConfigMap"
    ]
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(config["data"]["probe.py"])
    return path


def run_probe(
    probe: Path, path: str, port: int, ca: egress_net.TestCA, client: egress_net.TestCA, tmp: Path
) -> int:
    leaf = client.issue(tmp, ["kernelhub-node"])  # cert and key in one PEM file
    env = {
        **os.environ,
        "KERNELHUB_CLUSTER__CA_FILE": str(ca.cert_file),
        "KERNELHUB_CLUSTER__CERT_FILE": str(leaf),
        "KERNELHUB_CLUSTER__KEY_FILE": str(leaf),
        "KERNELHUB_GATEWAY__PORT": str(port),
    }
    result = subprocess.run(
        [sys.executable, str(probe), path], env=env, capture_output=True, timeout=30 * UNIT
    )
    return result.returncode


def test_the_probe_passes_on_200_and_fails_on_503_over_mutual_tls(
    probe: Path, tmp_path: Path
) -> None:
    ca = make_ca(tmp_path / "ca")
    with mutual_tls_server(ca, tmp_path) as port:
        assert run_probe(probe, "/healthz", port, ca, ca, tmp_path) == 0
        assert run_probe(probe, "/readyz", port, ca, ca, tmp_path) != 0


def test_without_a_certificate_of_the_cluster_ca_nothing_gets_an_answer(
    probe: Path, tmp_path: Path
) -> None:
    """Why the probe is an exec with the pod's certificate: the kubelet's httpGet (no
    client certificate) fails the handshake, and so does a certificate of another CA."""
    ca, stranger = make_ca(tmp_path / "ca"), make_ca(tmp_path / "other")
    with mutual_tls_server(ca, tmp_path) as port:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=10 * UNIT)
        assert run_probe(probe, "/healthz", port, ca, stranger, tmp_path) != 0
