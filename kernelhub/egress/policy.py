"""What the egress proxy allows: pure decisions on names, ports and addresses.

Every request the proxy sees is reduced to ``(host, port)`` and decided here, in this
order (:func:`decide`):

1. the host must be a DNS name: IP literals in any spelling (``10.0.0.1``, ``[::1]``,
   ``2130706433``, ``0x7f.1``) are refused, so no allowlist is walked around by address;
2. a destination the session has denied stays denied; one it granted is allowed;
3. the policy's ``allow`` rules allow; otherwise the policy asks a human, or refuses.

After the name is allowed the proxy resolves it itself and :func:`address_problem`
refuses any answer that is not a public unicast address (loopback, private, link-local,
CGNAT, multicast, reserved, and IPv6 forms that embed such an IPv4).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from enum import Enum

from kernelhub.config import EgressPolicy

DEFAULT_PORTS = frozenset({80, 443})
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
# inet_aton accepts these as IPv4: "127.1", "0x7f000001", "017700000001", "2130706433".
_NUMERIC = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}\.?$")


class Verdict(Enum):
    ALLOW = "allow"
    ASK = "ask"
    DENY = "deny"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str


@dataclass(frozen=True)
class Rule:
    """One ``allow`` entry: a name or ``*.suffix``, and its ports."""

    pattern: str
    ports: frozenset[int]

    def matches(self, host: str, port: int) -> bool:
        if port not in self.ports:
            return False
        if self.pattern.startswith("*."):
            return host.endswith(self.pattern[1:])
        return host == self.pattern


def parse_rule(text: str) -> Rule:
    """``"api.example.com"``, ``"*.example.com:443"``, ``"h.example.com:80,8080"``.
    Raises ValueError naming the entry."""
    name, _, ports_text = text.strip().lower().partition(":")
    wildcard = name.startswith("*.")
    problem = host_problem(name[2:] if wildcard else name)
    if problem is not None:
        raise ValueError(f"egress rule {text!r}: {problem}")
    try:
        ports = frozenset(int(p) for p in ports_text.split(",")) if ports_text else DEFAULT_PORTS
    except ValueError:
        raise ValueError(f"egress rule {text!r}: ports must be numbers, as in :443,8443") from None
    if not all(0 < p < 65536 for p in ports):
        raise ValueError(f"egress rule {text!r}: a port is out of range")
    return Rule(name, ports)


def normalize_host(host: str) -> str:
    return host.strip().lower().removesuffix(".")


def host_problem(host: str) -> str | None:
    """Why ``host`` (normalized) is not a DNS name we connect to, or None."""
    bare = host.strip("[]")
    try:
        ipaddress.ip_address(bare)
        return f"{host} is an IP address; egress goes to names only"
    except ValueError:
        pass
    if _NUMERIC.match(host):
        return f"{host} is a numeric address; egress goes to names only"
    labels = host.split(".")
    if len(host) > 253 or len(labels) < 2 or not all(_LABEL.match(label) for label in labels):
        return f"{host!r} is not a valid domain name"
    return None


def address_problem(address: str) -> str | None:
    """Why the proxy must not connect to ``address`` (a resolver's answer), or None."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or _nat64(ip)
        if embedded is not None:
            ip = embedded
    if ip.is_multicast or not ip.is_global:
        kind = (
            "loopback"
            if ip.is_loopback
            else "link-local"
            if ip.is_link_local
            else "private"
            if ip.is_private
            else "multicast"
            if ip.is_multicast
            else "not public"
        )
        return f"{address} is {kind}"
    return None


def _nat64(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip in ipaddress.IPv6Network("64:ff9b::/96"):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def rules_of(policy: EgressPolicy) -> tuple[Rule, ...]:
    return tuple(parse_rule(entry) for entry in policy.allow)


def decide(
    policy: EgressPolicy | None,
    host: str,
    port: int,
    *,
    rules: tuple[Rule, ...] | None = None,
    granted: frozenset[tuple[str, int]] = frozenset(),
    denied: frozenset[tuple[str, int]] = frozenset(),
    policy_name: str | None = None,
) -> Decision:
    """The verdict on ``host:port`` (``host`` normalized) for a session with ``policy``
    (None: no egress) and its answers so far (``granted``/``denied`` for the session)."""
    problem = host_problem(host)
    if problem is not None:
        return Decision(Verdict.DENY, problem)
    if policy is None:
        return Decision(
            Verdict.DENY,
            "this session has no egress policy; the operator sets one with "
            "KERNELHUB_EGRESS__DEFAULT_POLICY, or a session asks for one by name",
        )
    if (host, port) in denied:
        return Decision(Verdict.DENY, f"{host}:{port} was denied for this session")
    if (host, port) in granted:
        return Decision(Verdict.ALLOW, f"{host}:{port} was allowed for this session")
    for rule in rules if rules is not None else rules_of(policy):
        if rule.matches(host, port):
            return Decision(Verdict.ALLOW, f"allowed by {rule.pattern}")
    named = f"policy {policy_name!r}" if policy_name else "the session's policy"
    if policy.ask:
        return Decision(Verdict.ASK, f"{host}:{port} is not on {named}")
    return Decision(Verdict.DENY, f"{host}:{port} is not on {named}")


class Answer(Enum):
    """What a human answered the gate."""

    ONCE = "once"
    SESSION = "session"
    DENY = "deny"


#: How every gate question ends; MCP clients get a three-way choice for it.
GATE_SUFFIX = " answer once, session or deny [deny] "


def gate_prompt(host: str, port: int) -> str:
    return f"allow network access to {host}:{port} for this session?{GATE_SUFFIX}"


def parse_answer(text: str) -> Answer:
    """``once``/``yes``/``y`` -> ONCE, ``session``/``always``/``s`` -> SESSION, anything
    else (including EOF from the deadline) -> DENY."""
    word = text.strip().lower()
    if word in {"once", "o", "y", "yes", "allow"}:
        return Answer.ONCE
    if word in {"session", "s", "always", "a"}:
        return Answer.SESSION
    return Answer.DENY


def header_values(policy: EgressPolicy | None, host: str) -> dict[str, str]:
    """The operator's credentials for ``host`` (exact name, then ``*.suffix`` entries)."""
    if policy is None:
        return {}
    for pattern, headers in policy.headers.items():
        pattern = normalize_host(pattern)
        if pattern == host or (pattern.startswith("*.") and host.endswith(pattern[1:])):
            return {name: value.get_secret_value() for name, value in headers.items()}
    return {}


class Meter:
    """Bytes a session moved through the proxy, against its quota."""

    def __init__(self, quota_bytes: int | None) -> None:
        self.quota_bytes = quota_bytes
        self.used_bytes = 0

    def add(self, count: int) -> bool:
        """Count ``count`` bytes; False once the quota is passed."""
        self.used_bytes += count
        return not self.exhausted

    @property
    def exhausted(self) -> bool:
        return self.quota_bytes is not None and self.used_bytes > self.quota_bytes
