"""The egress policy's pure decisions, with data."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from kernelhub.config import EgressPolicy
from kernelhub.egress.policy import (
    Answer,
    Meter,
    Verdict,
    address_problem,
    decide,
    header_values,
    host_problem,
    parse_answer,
    parse_rule,
)

POLICY = EgressPolicy(allow=["api.example.com", "*.cdn.example.org:443", "h.example.net:80,8080"])


@pytest.mark.parametrize(
    ("host", "port", "verdict"),
    [
        ("api.example.com", 443, Verdict.ALLOW),
        ("api.example.com", 80, Verdict.ALLOW),
        ("api.example.com", 22, Verdict.ASK),
        ("x.api.example.com", 443, Verdict.ASK),  # an exact name is not a wildcard
        ("a.cdn.example.org", 443, Verdict.ALLOW),
        ("a.b.cdn.example.org", 443, Verdict.ALLOW),
        ("cdn.example.org", 443, Verdict.ASK),  # *.x is subdomains only
        ("evilcdn.example.org", 443, Verdict.ASK),
        ("a.cdn.example.org", 80, Verdict.ASK),
        ("h.example.net", 8080, Verdict.ALLOW),
        ("h.example.net", 443, Verdict.ASK),
        ("other.example.com", 443, Verdict.ASK),
    ],
)
def test_rules_match_names_wildcards_and_ports(host: str, port: int, verdict: Verdict) -> None:
    assert decide(POLICY, host, port).verdict is verdict


@pytest.mark.parametrize(
    "host",
    ["10.0.0.1", "127.0.0.1", "[::1]", "::1", "2130706433", "0x7f000001", "127.1", "0x7f.1",
     "017700000001", "1.2.3.4.", "localhost", "-bad-.example.com", "a..example.com", ""],
)  # fmt: skip
def test_ip_literals_in_any_spelling_and_bad_names_are_denied(host: str) -> None:
    assert host_problem(host) is not None
    assert decide(EgressPolicy(allow=["*.example.com"]), host, 443).verdict is Verdict.DENY


def test_without_a_policy_everything_is_denied_saying_how_to_get_one() -> None:
    d = decide(None, "api.example.com", 443)
    assert d.verdict is Verdict.DENY and "KERNELHUB_EGRESS__DEFAULT_POLICY" in d.reason


def test_a_policy_that_does_not_ask_denies_and_names_itself() -> None:
    d = decide(EgressPolicy(ask=False), "api.example.com", 443, policy_name="strict")
    assert d.verdict is Verdict.DENY and "not on policy 'strict'" in d.reason


def test_the_sessions_answers_come_before_the_rules() -> None:
    key = ("api.example.com", 443)
    assert decide(POLICY, *key, denied=frozenset({key})).verdict is Verdict.DENY
    other = ("new.example.com", 443)
    assert decide(POLICY, *other, granted=frozenset({other})).verdict is Verdict.ALLOW


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.1.1", "private"),
        ("172.16.0.1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("100.64.0.1", "not public"),  # CGNAT
        ("0.0.0.0", "private"),
        ("224.0.0.1", "multicast"),
        ("::1", "loopback"),
        ("fe80::1", "link-local"),
        ("fd00::1", "private"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
        ("2002:a00:1::", "private"),  # 6to4 of 10.0.0.1
    ],
)
def test_private_loopback_and_link_local_answers_are_refused(address: str, kind: str) -> None:
    problem = address_problem(address)
    assert problem is not None and kind in problem


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"])
def test_public_answers_pass(address: str) -> None:
    assert address_problem(address) is None


def test_rules_refuse_addresses_and_bad_ports() -> None:
    with pytest.raises(ValueError, match="IP address"):
        parse_rule("10.0.0.1:443")
    with pytest.raises(ValueError, match="out of range"):
        parse_rule("a.example.com:70000")
    with pytest.raises(ValueError, match="numbers"):
        parse_rule("a.example.com:https")
    assert parse_rule("A.Example.COM").pattern == "a.example.com"


@pytest.mark.parametrize(
    ("text", "answer"),
    [("once", Answer.ONCE), ("y", Answer.ONCE), (" Session ", Answer.SESSION),
     ("always", Answer.SESSION), ("deny", Answer.DENY), ("", Answer.DENY),
     ("\x04", Answer.DENY), ("maybe", Answer.DENY)],
)  # fmt: skip
def test_gate_answers_default_to_deny(text: str, answer: Answer) -> None:
    assert parse_answer(text) is answer


def test_headers_for_a_domain_exact_then_wildcard() -> None:
    policy = EgressPolicy(
        headers={
            "api.example.com": {"Authorization": SecretStr("Bearer a")},
            "*.example.org": {"X-Key": SecretStr("b")},
        }
    )
    assert header_values(policy, "api.example.com") == {"Authorization": "Bearer a"}
    assert header_values(policy, "x.example.org") == {"X-Key": "b"}
    assert header_values(policy, "example.org") == {}
    assert header_values(None, "api.example.com") == {}
    assert "Bearer a" not in repr(policy)


def test_the_meter_cuts_past_the_quota_and_none_means_no_quota() -> None:
    meter = Meter(100)
    assert meter.add(60) and meter.add(40)
    assert not meter.add(1) and meter.exhausted
    unlimited = Meter(None)
    assert unlimited.add(10**12) and not unlimited.exhausted
