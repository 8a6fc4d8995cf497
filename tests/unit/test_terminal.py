"""The terminal sanitizer: sandbox output keeps its colours and loses every other command."""

from __future__ import annotations

import pytest

from kernelhub.terminal import MAX_PENDING, TerminalFilter, strip_controls

RED = "\x1b[31m"
RESET = "\x1b[0m"

ATTACKS = [
    ("osc52 clipboard, BEL", "a\x1b]52;c;ZWNobyBwd25lZA==\x07b", "ab"),
    ("osc52 clipboard, ST", "a\x1b]52;c;ZWNobw==\x1b\\b", "ab"),
    ("osc8 link", "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\", "click"),
    ("window title", "\x1b]0;sudo rm -rf /\x07ok", "ok"),
    ("clear screen", "hidden\x1b[2J\x1b[Hshown", "hiddenshown"),
    ("cursor up and erase line", "ran\x1b[1A\x1b[2Kx", "ranx"),
    ("hide cursor (private mode)", "\x1b[?25lx\x1b[?25h", "x"),
    ("alternate screen", "\x1b[?1049hx", "x"),
    ("DCS", "a\x1bPq#0;2;0;0;0\x1b\\b", "ab"),
    ("APC", "a\x1b_Gf=100;AAAA\x1b\\b", "ab"),
    ("PM and SOS", "a\x1b^pm\x1b\\b\x1bXsos\x1b\\c", "abc"),
    ("full reset", "a\x1bcb", "ab"),
    ("save cursor / charset", "a\x1b7\x1b(0b\x1b8", "ab"),
    ("8-bit CSI clear", "a\x9b2Jb", "ab"),
    ("8-bit OSC", "a\x9d52;c;eA==\x9cb", "ab"),
    ("backspace overwrite", "rm -rf\x08\x08\x08\x08\x08\x08ls", "rm -rfls"),
    ("bell, NUL, DEL, form feed, vertical tab", "a\x07\x00\x7f\x0c\x0bb", "ab"),
    ("stray ESC at the end", "ab\x1b", "ab"),
    ("unterminated OSC leaves inert text", "a\x1b]52;c;eA==", "a52;c;eA=="),
]


@pytest.mark.parametrize(
    ("text", "expected"), [a[1:] for a in ATTACKS], ids=[a[0] for a in ATTACKS]
)
def test_control_sequences_are_removed(text: str, expected: str) -> None:
    assert strip_controls(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        f"{RED}KeyError{RESET}: 'x'",
        "\x1b[1;38;5;208mbold orange\x1b[m",
        "\x1b[38:2:255:0:0mtruecolour\x1b[0m",
        "plain text, tabs\tand\nnewlines\r\nand a progress bar\r 50%\r100%",
        "unicode: héllo ✓ 日本",
    ],
)
def test_colours_and_text_stay(text: str) -> None:
    assert strip_controls(text) == text


def test_8bit_sgr_becomes_7bit() -> None:
    assert strip_controls("\x9b31mred") == "\x1b[31mred"


@pytest.mark.parametrize("cut", range(1, 16))
def test_a_sequence_split_across_chunks_is_still_removed(cut: int) -> None:
    text = f"x\x1b]52;c;aGk=\x07{RED}y\x1b[2Jz"
    f = TerminalFilter()
    out = f.feed(text[:cut]) + f.feed(text[cut:]) + f.flush()
    assert out == f"x{RED}yz"


def test_every_chunking_byte_by_byte() -> None:
    text = "a\x1b]8;;http://e/\x1b\\b\x1b[31mc\x1b[?25ld"
    f = TerminalFilter()
    assert "".join(f.feed(ch) for ch in text) + f.flush() == "ab\x1b[31mcd"


def test_an_endless_sequence_is_not_held_forever() -> None:
    f = TerminalFilter()
    out = f.feed("\x1b]52;c;" + "A" * (MAX_PENDING + 10))
    assert out.startswith("52;c;AAAA") and "\x1b" not in out
    assert f.flush() == ""


def test_without_colours_nothing_is_left() -> None:
    assert strip_controls(f"{RED}a\x1b]0;t\x07b{RESET}", colours=False) == "ab"
