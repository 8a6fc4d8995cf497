"""Egress settings (issue #25): the policies a sandbox's way out is checked against, kept
beside the proxy that reads them; config.py nests them as ``Settings.egress``."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

MiB = 1024 * 1024


class EgressPolicy(BaseModel):
    """Where a session's code may connect, through the egress proxy (docs/egress.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: list[str] = Field(
        default_factory=list,
        description='destinations allowed without asking: "api.example.com", '
        '"*.example.com" (subdomains only), with ":443" or ":80,8080" for ports '
        "(default 80 and 443). Never an IP address",
    )
    ask: bool = Field(
        True,
        description="a destination not on the list waits for a human (once / session / "
        "deny, answered like confirm()); false: refused at once",
    )
    quota_bytes: int | None = Field(
        256 * MiB,
        ge=0,
        description="bytes a session may move through the proxy, both directions, all "
        "connections; past it every connection is cut. None: no quota",
    )
    headers: dict[str, dict[str, SecretStr]] = Field(
        default_factory=dict,
        description='credentials the proxy adds for a domain, e.g. {"api.example.com": '
        '{"Authorization": "Bearer ..."}}; the sandbox never sees them. For HTTPS the '
        "proxy terminates TLS for that domain with KERNELHUB_EGRESS__CA_CERT_FILE",
    )


class EgressSettings(BaseModel):
    """The egress proxy: the sandbox's only way out, by policy (docs/egress.md)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True,
        description="give Docker sandboxes the egress proxy (HTTP_PROXY on a loopback "
        "port, forwarded to a Unix socket); with no policy it refuses everything, saying why",
    )
    port: int = Field(
        3128, ge=1, le=65535, description="the proxy's port on the sandbox's loopback"
    )
    policies: dict[str, EgressPolicy] = Field(
        default_factory=dict,
        description='named policies, e.g. {"pypi": {"allow": ["pypi.org", '
        '"files.pythonhosted.org"]}}',
    )
    default_policy: str | None = Field(
        None, description="the policy of a session that names none; None: no egress at all"
    )
    principal_policies: dict[str, str] = Field(
        default_factory=dict,
        description='the default policy per principal (token name), e.g. {"ci": "pypi"}',
    )
    allowed_policies: dict[str, list[str]] = Field(
        default_factory=dict,
        description='the policies a principal may ask for at session creation ("egress": '
        'NAME); key "*" for every principal, e.g. {"*": ["pypi"], "admin": ["open"]}',
    )
    hosts: dict[str, str] = Field(
        default_factory=dict,
        description="pinned upstreams: a name and the address it is served from, e.g. "
        '{"pypi.internal": "10.0.0.5:8443"}; the operator vouches for these, so they skip '
        "the private-range check (an internal mirror). Policy still decides who may use them",
    )
    nameserver: str | None = Field(
        None,
        description='a DNS server the proxy asks ("127.0.0.1:53") instead of the host\'s resolver',
    )
    ca_cert_file: Path | None = Field(
        None,
        description="PEM CA certificate the proxy signs the domains it adds headers to "
        "with; sandboxes trust it (mounted read-only, added to their SSL_CERT_FILE)",
    )
    ca_key_file: Path | None = Field(None, description="the private key of ca_cert_file (PEM)")
    upstream_ca_file: Path | None = Field(
        None,
        description="CA bundle the proxy checks upstream servers against where it "
        "terminates TLS; None: the host's default roots",
    )
    connect_timeout: float = Field(10.0, gt=0, description="seconds to connect upstream")
    max_connections: int = Field(
        64, ge=1, description="connections one session may have open through the proxy"
    )
    wheelhouse: Path | None = Field(
        None,
        description="a directory of wheels mounted read-only in every Docker sandbox at "
        "/opt/wheelhouse: `pip install` in a cell installs from it, offline",
    )
    index_url: str | None = Field(
        None,
        description="a package index (a mirror) `pip install` in a cell may also use, "
        "reached through the proxy under the session's egress policy",
    )
