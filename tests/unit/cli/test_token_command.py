"""``kernelhub token`` in process against a real store in a temporary data directory:
a token made is shown once and then works, list names it (never its secret), revoke ends
it and says so when there is nothing to revoke; and client commands refuse to start
without a token, or with options that contradict each other, with exit status 2."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kernelhub.cli import main
from kernelhub.config import load_settings
from kernelhub.store import open_store


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KERNELHUB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("KERNELHUB_TOKEN", raising=False)
    return tmp_path / "data"


def principal_of(data_dir: Path, token: str) -> tuple[str, bool, bool] | None:
    async def look() -> tuple[str, bool, bool] | None:
        store = await open_store(load_settings(data_dir=data_dir))
        try:
            p = await store.principal_for(token)
            return None if p is None else (p.name, p.admin, p.read_only)
        finally:
            await store.close()

    return asyncio.run(look())


def test_a_token_is_made_listed_and_revoked(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["token", "create", "--name", "ci", "--read-only"]) == 0
    token = capsys.readouterr().out.strip()
    assert principal_of(data_dir, token) == ("ci", False, True)
    assert main(["token", "create", "--name", "ops", "--admin"]) == 0
    admin_token = capsys.readouterr().out.strip()
    assert admin_token != token and principal_of(data_dir, admin_token) == ("ops", True, False)

    assert main(["token", "list", "--json"]) == 0
    listed = capsys.readouterr().out
    assert sorted(t["name"] for t in json.loads(listed)) == ["ci", "ops"]
    assert token not in listed and admin_token not in listed

    assert main(["token", "revoke", "ci"]) == 0
    assert capsys.readouterr().out.strip() == "revoked ci"
    assert principal_of(data_dir, token) is None
    assert main(["token", "revoke", "ci"]) == 1
    assert "no active token named 'ci'" in capsys.readouterr().err


def test_a_taken_name_is_refused(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["token", "create", "--name", "ci"]) == 0
    capsys.readouterr()
    assert main(["token", "create", "--name", "ci"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kernelhub: ") and "ci" in err


def test_client_commands_need_a_token(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["exec", "print(1)"]) == 2
    assert "no token: pass --token or set KERNELHUB_TOKEN" in capsys.readouterr().err


def test_keep_with_an_existing_session_is_a_usage_error(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["exec", "--token", "t", "--session", "s1", "--keep", "print(1)"]) == 2
    assert "--keep is for the new session exec makes" in capsys.readouterr().err
