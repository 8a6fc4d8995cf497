"""A node agent and a replica refuse to start without what they need, naming each
variable; a node serves mutual TLS only (a client certificate is required)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from kernelhub.cluster.certs import make_certs
from kernelhub.cluster.node import check_node_settings, tls_options
from kernelhub.cluster.proxy import client_context
from kernelhub.config import Settings, load_settings
from kernelhub.errors import ConfigError


def node_settings(certs: Path, **cluster: object) -> Settings:
    return load_settings(
        store={"url": "postgresql://kh@127.0.0.1:5432/kh", "node": "n1"},
        cluster={
            "address": "https://10.0.0.5:8766",
            "ca_file": certs / "ca.pem",
            "cert_file": certs / "node-n1.pem",
            "key_file": certs / "node-n1.key",
            **cluster,
        },
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_certs(out, ["n1"], ["g1"])
    return out


def test_a_complete_node_passes_and_requires_client_certificates(certs: Path) -> None:
    settings = node_settings(certs)
    check_node_settings(settings)
    assert tls_options(settings)["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert tls_options(settings)["ssl_ca_certs"] == str(certs / "ca.pem")


def test_every_missing_setting_is_named() -> None:
    with pytest.raises(ConfigError) as caught:
        check_node_settings(load_settings())
    for var in ("ADDRESS", "CA_FILE", "CERT_FILE", "KEY_FILE", "STORE__URL", "STORE__NODE"):
        assert var in str(caught.value)


def test_plain_http_addresses_and_missing_files_are_refused(certs: Path) -> None:
    with pytest.raises(ConfigError, match="serves mutual TLS only"):
        check_node_settings(node_settings(certs, address="http://10.0.0.5:8766"))
    with pytest.raises(ConfigError, match=r"KERNELHUB_CLUSTER__KEY_FILE names .* not a file"):
        check_node_settings(node_settings(certs, key_file=certs / "nope.key"))


def test_a_replica_needs_its_certificate_and_verifies_nodes(certs: Path) -> None:
    with pytest.raises(ConfigError, match="KERNELHUB_CLUSTER__CERT_FILE"):
        client_context(load_settings(cluster={"ca_file": certs / "ca.pem"}))
    ctx = client_context(
        load_settings(
            cluster={
                "ca_file": certs / "ca.pem",
                "cert_file": certs / "gateway-g1.pem",
                "key_file": certs / "gateway-g1.key",
            }
        )
    )
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
