"""``kernelhub cluster certs``: a cluster CA and the leaf certificates its node agents and
gateway replicas present to each other (mutual TLS, issue #24).

The CA is the cluster's identity: a node agent accepts a TLS client only if its
certificate chains to this CA, so whoever holds ``ca.key`` can join gateways to the
cluster. Keep it offline once the leaves exist. Private keys are written 0600.

Layout under ``--out DIR``::

    ca.pem  ca.key                 the cluster CA
    node-<id>.pem  node-<id>.key   one per node agent (server and client auth, SANs)
    gateway-<id>.pem  gateway-<id>.key   one per gateway replica (client auth)
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kernelhub.errors import UsageError

# Long enough that a small cluster is not re-keyed by surprise; short enough that a lost
# key does not stay valid for a decade.
CA_DAYS = 3650
LEAF_DAYS = 825


_CA_USAGE = x509.KeyUsage(
    digital_signature=True,
    key_cert_sign=True,
    crl_sign=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    encipher_only=False,
    decipher_only=False,
)


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _name(common: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kernelhub cluster"),
            x509.NameAttribute(NameOID.COMMON_NAME, common),
        ]
    )


def san_entries(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """IP addresses as IP SANs, anything else as a DNS name (pure, tested)."""
    out: list[x509.GeneralName] = []
    for host in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            out.append(x509.DNSName(host))
    return out


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Created 0600 from the start: never readable by others, even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class ClusterCA:
    """A CA that signs the cluster's leaves; loaded from or written to a directory."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key = key
        self.cert = cert

    @classmethod
    def create(cls, name: str = "kernelhub cluster CA") -> ClusterCA:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_CA_USAGE, critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @classmethod
    def load(cls, out: Path) -> ClusterCA:
        key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise UsageError(f"{out / 'ca.key'} is not the EC key `kernelhub cluster certs` makes")
        return cls(key, x509.load_pem_x509_certificate((out / "ca.pem").read_bytes()))

    def save(self, out: Path) -> Issued:
        _write_cert(out / "ca.pem", self.cert)
        _write_key(out / "ca.key", self.key)
        return Issued(out / "ca.pem", out / "ca.key")

    def issue(
        self, out: Path, stem: str, common: str, hosts: Sequence[str], *, server: bool
    ) -> Issued:
        """A leaf for ``common``: server and client auth for a node agent (``server``,
        with ``hosts`` as its SANs), client auth only for a gateway replica."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if hosts:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(san_entries(hosts)), critical=False
            )
        cert = builder.sign(self.key, hashes.SHA256())
        issued = Issued(out / f"{stem}.pem", out / f"{stem}.key")
        _write_cert(issued.cert, cert)
        _write_key(issued.key, key)
        return issued


def make_certs(
    out: Path,
    nodes: Sequence[str],
    gateways: Sequence[str],
    hosts: Sequence[str] = (),
) -> dict[str, Issued]:
    """The CA (reused when ``out`` has one) and a leaf per node and gateway. Every node
    cert carries ``hosts`` (plus its own id as a DNS name and localhost) as SANs: gateways
    verify the node they dial against them. Returns what was written, by stem."""
    for name in (*nodes, *gateways):
        if not name or "/" in name or name.startswith("."):
            raise UsageError(f"{name!r} is not a usable node or gateway name (letters, digits, -)")
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    written: dict[str, Issued] = {}
    if (out / "ca.key").exists():
        ca = ClusterCA.load(out)
    else:
        ca = ClusterCA.create()
        written["ca"] = ca.save(out)
    node_hosts = [*hosts, "localhost", "127.0.0.1"]
    for node in nodes:
        stem = f"node-{node}"
        written[stem] = ca.issue(out, stem, node, [node, *node_hosts], server=True)
    for gateway in gateways:
        stem = f"gateway-{gateway}"
        written[stem] = ca.issue(out, stem, gateway, [], server=False)
    return written
