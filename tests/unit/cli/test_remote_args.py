"""The gateway commands' own argument handling and failure output (kernelhub/cli/remote.py),
against a real loopback port nobody listens on: no gateway needed to check what the CLI
refuses before it connects, and how it reports each id it could not reach."""

from __future__ import annotations

import socket

import pytest

from kernelhub.cli import main
from kernelhub.cli.remote import _number, _pairs
from kernelhub.errors import UsageError


@pytest.fixture
def dead_url(monkeypatch: pytest.MonkeyPatch) -> str:
    """A loopback URL whose port was just free: connecting is refused at once."""
    monkeypatch.delenv("KERNELHUB_TOKEN", raising=False)
    monkeypatch.delenv("KERNELHUB_URL", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("60", 60), ("-3", -3), ("1.5", 1.5), ("1e3", 1000.0), ("abc", "abc"), ("", "")],
)
def test_numbers_become_numbers_the_rest_stays_text(value: str, expected: object) -> None:
    got = _number(value)
    assert got == expected and type(got) is type(expected)


def test_pairs_split_on_the_first_equals_sign() -> None:
    pairs = _pairs(["cell_timeout=60", "note=a=b", "ratio=0.5", "empty="], "--meta")
    assert pairs == {"cell_timeout": 60, "note": "a=b", "ratio": 0.5, "empty": ""}
    assert _pairs(None, "--limit") == {}


@pytest.mark.parametrize("item", ["bad", "=60", ""])
def test_a_pair_without_a_name_or_equals_names_the_flag_and_item(item: str) -> None:
    with pytest.raises(UsageError) as raised:
        _pairs(["ok=1", item], "--limit")
    assert f"--limit {item!r}" in str(raised.value) and "NAME=VALUE" in str(raised.value)


def test_no_token_is_a_usage_error_naming_both_ways_to_give_one(
    dead_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--url", dead_url, "sessions", "ls"]) == 2
    err = capsys.readouterr().err
    assert "no token" in err and "--token" in err and "KERNELHUB_TOKEN" in err


def test_keep_with_an_existing_session_is_refused_before_connecting(
    dead_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--url", dead_url, "--token", "t", "exec", "--session", "s1", "--keep", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--keep" in err and "--session" in err and "cannot reach" not in err


def test_a_bad_limit_is_refused_before_connecting(
    dead_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--url", dead_url, "--token", "t", "sessions", "new", "--limit", "memory"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--limit 'memory'" in err and "cannot reach" not in err


def test_rm_reports_every_id_it_could_not_delete_and_fails(
    dead_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--url", dead_url, "--token", "t", "sessions", "rm", "s1", "s2"]) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert [line.split(":", 2)[1].strip() for line in lines] == ["s1", "s2"]
    assert all("cannot reach" in line and dead_url in line for line in lines)
    assert "deleted" not in out


def test_an_unreachable_gateway_names_the_url_and_how_to_start_one(
    dead_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--url", dead_url, "--token", "t", "sessions", "show", "s1"]) == 1
    err = capsys.readouterr().err
    assert dead_url in err and "kernelhub serve" in err
