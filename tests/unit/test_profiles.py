"""Trust tiers: choosing a session's profile, and what isolation it needs, with data."""

from __future__ import annotations

import pytest

from kernelhub.config import EgressPolicy, EgressSettings, Profile, ProfileSettings
from kernelhub.errors import ConfigError, ForbiddenError, InvalidRequestError
from kernelhub.profiles import check_profiles, choose_profile, runtime_for

TIERS = ProfileSettings(
    tiers={
        "untrusted": Profile(isolation="gvisor", egress="pypi"),
        "trusted": Profile(isolation="docker"),
        "laptop": Profile(isolation="local"),
        "any": Profile(),
    },
    default="trusted",
    tokens={"ci-bot": ["untrusted", "any"]},
)


def test_a_restricted_token_gets_its_first_profile_and_only_its_own() -> None:
    chosen = choose_profile(TIERS, "ci-bot", None)
    assert chosen is not None and chosen.name == "untrusted"
    assert choose_profile(TIERS, "ci-bot", "any").name == "any"  # type: ignore[union-attr]
    with pytest.raises(ForbiddenError, match="KERNELHUB_PROFILES__TOKENS"):
        choose_profile(TIERS, "ci-bot", "trusted")


def test_other_tokens_get_the_default_or_what_they_ask_for() -> None:
    assert choose_profile(TIERS, "alice", None).name == "trusted"  # type: ignore[union-attr]
    assert choose_profile(TIERS, "alice", "laptop").name == "laptop"  # type: ignore[union-attr]
    assert choose_profile(ProfileSettings(), "alice", None) is None
    with pytest.raises(InvalidRequestError, match="no profile 'gold'"):
        choose_profile(TIERS, "alice", "gold")


@pytest.mark.parametrize(
    ("name", "backend", "runtimes", "expected"),
    [
        ("trusted", "docker", {"runc"}, "runc"),
        ("untrusted", "docker", {"runc", "runsc"}, "runsc"),
        ("laptop", "local", set(), None),
        ("any", "docker", {"runc"}, None),
    ],
)
def test_the_runtime_for_each_isolation(
    name: str, backend: str, runtimes: set[str], expected: str | None
) -> None:
    assert runtime_for(choose_profile(TIERS, "x", name), backend, frozenset(runtimes)) == expected


@pytest.mark.parametrize(
    ("name", "backend", "runtimes", "words"),
    [
        ("untrusted", "docker", {"runc"}, "runsc"),
        ("laptop", "docker", {"runc"}, "needs the local backend"),
        ("trusted", "local", set(), "needs the docker backend"),
    ],
)
def test_an_isolation_this_gateway_cannot_give_is_refused_saying_why(
    name: str, backend: str, runtimes: set[str], words: str
) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        runtime_for(choose_profile(TIERS, "x", name), backend, frozenset(runtimes))


def test_profiles_naming_missing_policies_or_profiles_fail_closed() -> None:
    egress = EgressSettings(policies={"pypi": EgressPolicy()})
    check_profiles(TIERS, egress)
    with pytest.raises(ConfigError, match="egress policy 'pypi'"):
        check_profiles(TIERS, EgressSettings())
    with pytest.raises(ConfigError, match="KERNELHUB_PROFILES__DEFAULT"):
        check_profiles(ProfileSettings(default="gold"), egress)
    with pytest.raises(ConfigError, match="no profile at all"):
        check_profiles(ProfileSettings(tokens={"bot": []}), egress)
