"""The command line itself: every command and option explains itself, --version, mcp."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kernelhub import __version__
from kernelhub.cli import build_parser, main


def _walk(parser: argparse.ArgumentParser, path: str = "kernelhub"):  # type: ignore[no-untyped-def]
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _walk(child, f"{path} {name}")


def test_every_option_and_argument_has_help() -> None:
    missing = [
        f"{path}: {action.option_strings or action.dest}"
        for path, parser in _walk(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not action.help
    ]
    assert missing == []


def test_every_command_has_help_in_its_parents_listing() -> None:
    for path, parser in _walk(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                listed = {a.dest for a in action._choices_actions}
                assert listed == set(action.choices), path
                assert all(a.help for a in action._choices_actions), path


def test_top_help_is_a_description_and_lists_mcp(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert (
        "sandboxed IPython kernels" in out and "KERNELHUB_URL" in out and "KERNELHUB_TOKEN" in out
    )
    assert "\n    mcp " in out and "argument parsing" not in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"kernelhub {__version__}"


def test_mcp_help_names_the_kernelhub_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kernelhub.cli", "mcp", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("usage: kernelhub mcp")
    assert "python -m" not in out.stdout


@pytest.mark.parametrize(
    ("argv", "env", "url", "token"),
    [
        (["sessions", "ls"], {}, "http://127.0.0.1:8765", None),
        (
            ["sessions", "ls"],
            {"KERNELHUB_URL": "http://h:1", "KERNELHUB_TOKEN": "t"},
            "http://h:1",
            "t",
        ),
        (
            ["--url", "http://a:2", "sessions", "ls"],
            {"KERNELHUB_URL": "http://h:1"},
            "http://a:2",
            None,
        ),
        (
            ["sessions", "ls", "--url", "http://b:3", "--token", "x"],
            {"KERNELHUB_TOKEN": "t"},
            "http://b:3",
            "x",
        ),
    ],
)
def test_url_and_token_from_flags_before_or_after_the_command_or_the_environment(
    argv: list[str],
    env: dict[str, str],
    url: str,
    token: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kernelhub.cli import _resolve_client

    monkeypatch.delenv("KERNELHUB_URL", raising=False)
    monkeypatch.delenv("KERNELHUB_TOKEN", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(argv)
    _resolve_client(args)
    assert (args.url, args.token) == (url, token)


def test_no_token_says_which_flag_and_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KERNELHUB_TOKEN", raising=False)
    assert main(["sessions", "ls"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kernelhub: no token: pass --token or set KERNELHUB_TOKEN")
    assert "Traceback" not in err


def test_an_unreachable_gateway_is_one_line_in_cli_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["sessions", "ls", "--url", f"http://127.0.0.1:{port}", "--token", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"127.0.0.1:{port}" in err and "--url" in err
    assert "base_url" not in err


def test_bad_limit_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sessions", "new", "--token", "t", "--limit", "nonsense"]) == 2
    assert "--limit 'nonsense': expected NAME=VALUE" in capsys.readouterr().err


def test_server_commands_without_the_server_extra_say_what_to_install() -> None:
    # The SDK-only install: the server's modules cannot be imported.
    blocker = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'pydantic_settings', 'docker', 'uvicorn'}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from kernelhub.cli import main\n"
        "raise SystemExit(main(['token', 'list']))\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "pip install 'kernelhub[server]'" in out.stderr and out.stderr.count("\n") == 1
