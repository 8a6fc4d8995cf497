"""serve's backend choice: which backend, why, what isolation, or the one thing to do."""

from __future__ import annotations

import pytest

from kernelhub.cli.serve import (
    BWRAP_ISOLATION,
    DOCKER_ISOLATION,
    NO_ISOLATION,
    DockerProbe,
    choose_backend,
)
from kernelhub.errors import BackendUnavailableError

SOCK = "unix:///var/run/docker.sock"
UP = DockerProbe(SOCK, None, installed=True)
DOWN = DockerProbe(SOCK, "connection refused", installed=True)
ABSENT = DockerProbe(SOCK, "no socket there", installed=False)
DENIED = DockerProbe(SOCK, "permission denied", installed=True)


@pytest.mark.parametrize(
    ("requested", "docker", "bwrap", "backend", "why", "isolation"),
    [
        ("auto", UP, None, "docker", f"answers at {SOCK}", DOCKER_ISOLATION),
        ("docker", UP, None, "docker", "asked for", DOCKER_ISOLATION),
        (
            "auto",
            DOWN,
            "/usr/bin/bwrap",
            "local",
            f"not reachable at {SOCK}: connection refused",
            BWRAP_ISOLATION,
        ),
        ("local", UP, "/usr/bin/bwrap", "local", "asked for", BWRAP_ISOLATION),
    ],
)
def test_the_choice_says_which_why_and_what_isolation(
    requested: str, docker: DockerProbe, bwrap: str | None, backend: str, why: str, isolation: str
) -> None:
    choice = choose_backend(requested, docker, bwrap=bwrap, unisolated=False, root=False)
    assert (choice.backend, choice.isolation) == (backend, isolation)
    assert why in choice.why
    assert len(choice.lines()) == 2 and all("\n" not in line for line in choice.lines())


def test_bubblewrap_is_said_to_be_weaker() -> None:
    assert "weaker than Docker" in BWRAP_ISOLATION


@pytest.mark.parametrize(
    ("requested", "docker", "bwrap", "root", "command"),
    [
        ("docker", DOWN, "/usr/bin/bwrap", False, "sudo systemctl start docker"),
        ("docker", ABSENT, None, True, "`apt-get install -y docker.io`"),
        ("docker", DENIED, None, False, "sudo usermod -aG docker $USER"),
        ("local", UP, None, False, "`sudo apt-get install -y bubblewrap`"),
        ("auto", ABSENT, None, False, "`sudo apt-get install -y docker.io bubblewrap`"),
        ("auto", DOWN, None, True, "systemctl start docker"),
    ],
)
def test_a_start_that_cannot_work_stops_with_the_command_that_fixes_it(
    requested: str, docker: DockerProbe, bwrap: str | None, root: bool, command: str
) -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        choose_backend(requested, docker, bwrap=bwrap, unisolated=False, root=root)
    message = str(caught.value)
    assert command in message and "\n" not in message
    assert ("sudo" in message) is (not root)


def test_never_a_silent_fall_back_to_no_isolation() -> None:
    with pytest.raises(BackendUnavailableError):
        choose_backend("auto", DOWN, bwrap=None, unisolated=False, root=False)
    chosen = choose_backend("auto", DOWN, bwrap=None, unisolated=True, root=False)
    assert chosen.isolation == NO_ISOLATION and "NONE" in chosen.lines()[1]
