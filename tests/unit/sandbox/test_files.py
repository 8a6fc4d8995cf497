"""The host's checks on the files program: paths before they are sent, bytes as they come."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kernelhub.errors import InvalidRequestError, SandboxError, TooLargeError
from kernelhub.sandbox.files import FILES_CWD, FILES_PROGRAM, capped, checked_path, file_error


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("", "empty"),
        ("a\x00b", "NUL"),
        ("a/%00", "encoded NUL"),
        ("new\nline", "control"),
        ("/etc/passwd", "absolute"),
        ("../escape", ".."),
        ("a/../../b", ".."),
        ("a" * 256, "longer than 255"),
        ("/".join(["d"] * 600), "1024"),
        ("bad\udcffutf8", "UTF-8"),
    ],
)
def test_malformed_paths_are_refused_with_what_is_wrong(path: str, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says):
        checked_path("get", path)


def test_good_paths_pass_unchanged() -> None:
    for path in ("a.txt", "dir/sub/file.bin", "ünïcode/名前.txt", "a/./b", "%41"):
        assert checked_path("put", path) == path
    assert checked_path("pack", "snap-1") == "snap-1"
    with pytest.raises(InvalidRequestError, match="single path component"):
        checked_path("unpack", "a/b")


def test_the_program_is_isolated_absolute_and_run_from_root() -> None:
    assert FILES_PROGRAM[:2] == ["-I", "-S"] and FILES_PROGRAM[2].startswith("/")
    assert FILES_CWD == "/"


async def lying(total: int, chunk: int = 65536) -> AsyncIterator[bytes]:
    """A program that claimed the file fits and then sends ``total`` bytes."""
    for _ in range(total // chunk):
        yield b"x" * chunk


async def test_a_download_is_cut_at_the_cap_whatever_the_inside_claims() -> None:
    got = 0
    with pytest.raises(TooLargeError, match="MAX_FILE_BYTES"):
        async for chunk in capped(lying(3 * 2**20), 2**20, "file 'big'"):
            got += len(chunk)
    assert got <= 2**20
    got = 0
    async for chunk in capped(lying(2**20), 2**20, "file 'fits'"):
        got += len(chunk)
    assert got == 2**20


def test_exit_codes_the_program_never_gives_are_sandbox_failures() -> None:
    assert isinstance(file_error(5, "x is not a regular file"), InvalidRequestError)
    assert isinstance(file_error(77, "y" * 10_000), SandboxError)
    error = file_error(2, "z" * 10_000)
    assert error is not None and len(str(error)) < 400
