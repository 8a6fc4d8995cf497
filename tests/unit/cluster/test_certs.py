"""`kernelhub cluster certs`: a CA, leaves that chain to it with the right uses and SANs,
private keys 0600, and a second run that keeps the CA (new leaves join the same cluster)."""

from __future__ import annotations

import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from kernelhub.cluster.certs import make_certs
from kernelhub.errors import UsageError


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_leaves_chain_to_the_ca_with_their_uses_and_sans(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    written = make_certs(out, ["n1"], ["g1"], ["10.0.0.5", "node1.example"])
    assert set(written) == {"ca", "node-n1", "gateway-g1"}
    ca = load(out / "ca.pem")
    node, gateway = load(out / "node-n1.pem"), load(out / "gateway-g1.pem")
    for leaf in (node, gateway):
        leaf.verify_directly_issued_by(ca)
    sans = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.0.0.5") in sans.get_values_for_type(x509.IPAddress)
    assert {"node1.example", "n1", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
    uses = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(uses)
    uses = gateway.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(uses) == [ExtendedKeyUsageOID.CLIENT_AUTH]  # a gateway cannot pose as a node
    for key in out.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    # What the node's TLS server loads: the pair matches, the CA verifies it.
    ctx = ssl.create_default_context(cafile=str(out / "ca.pem"))
    ctx.load_cert_chain(str(out / "node-n1.pem"), str(out / "node-n1.key"))


def test_a_second_run_keeps_the_ca(tmp_path: Path) -> None:
    make_certs(tmp_path, ["n1"], [])
    ca = (tmp_path / "ca.pem").read_bytes()
    written = make_certs(tmp_path, ["n2"], ["g2"])
    assert "ca" not in written and (tmp_path / "ca.pem").read_bytes() == ca
    load(tmp_path / "node-n2.pem").verify_directly_issued_by(load(tmp_path / "ca.pem"))


@pytest.mark.parametrize("name", ["", "../x", ".hidden"])
def test_names_that_are_not_file_stems_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UsageError, match="not a usable node or gateway name"):
        make_certs(tmp_path, [name], [])
