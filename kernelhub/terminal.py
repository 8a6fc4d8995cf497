"""What sandbox output may do to the terminal of the person reading it: colour, nothing more.

A cell's output is written by code we do not trust. On a terminal, escape sequences are
commands: OSC 52 writes the reader's clipboard, OSC 8 makes a link whose text lies about its
target, CSI ``2J`` / cursor moves / ``\\r`` tricks can hide lines that ran, DCS and APC
strings reach terminal extensions. :class:`TerminalFilter` keeps SGR (colours and text
attributes: ``ESC [ ... m``, which tracebacks use) and removes every other escape or control
sequence, including their 8-bit C1 forms. Text, ``\\n``, ``\\t`` and ``\\r`` stay (a lone
``\\r`` only returns to the start of the line; progress bars use it).

Pure: feed it text, get text back. Stream output arrives in chunks, so a sequence cut in two
by a chunk boundary is held until its end arrives (bounded by :data:`MAX_PENDING`).
"""

from __future__ import annotations

import re

#: A sequence still unterminated after this many characters is dropped, not held forever.
MAX_PENDING = 4096

# A complete CSI: ESC [ or the 8-bit CSI, parameters, intermediates, one final byte.
_CSI = r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
# String sequences (OSC, DCS, SOS, PM, APC), 7- and 8-bit, ended by BEL (OSC's habit) or ST.
_STRING = r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
# Any other escape: ESC, intermediates, a final byte (charset switches, DECSC, RIS ...).
_OTHER = r"\x1b[ -/]*[0-~]"
# C0 controls except \t \n \r (a stray ESC included), DEL, the C1 range.
_CONTROL = r"[\x00-\x08\x0b-\x0c\x0e-\x1f\x7f-\x9f]"
# One pass, so the ESC of a kept SGR is never seen again as a stray control.
_TOKEN = re.compile(f"{_STRING}|{_CSI}|{_OTHER}|{_CONTROL}")
_SGR = re.compile(r"(?:\x1b\[|\x9b)([0-9;:]*m)")
# The start of a sequence that may be cut off at the end of a chunk.
_OPEN = re.compile(
    r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*\x1b?\Z"
    r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*\Z"
    r"|\x1b[ -/]*\Z"
)


def _keep_sgr(match: re.Match[str]) -> str:
    sgr = _SGR.fullmatch(match.group(0))
    return "\x1b[" + sgr.group(1) if sgr else ""


def strip_controls(text: str, *, colours: bool = True) -> str:
    """``text`` with every escape and control sequence removed except SGR colours (those
    too without ``colours``: for a status line whose width must be known)."""
    return _TOKEN.sub(_keep_sgr if colours else "", text)


class TerminalFilter:
    """:func:`strip_controls` for a stream of chunks: a sequence split across chunks is
    recognised as a whole. Call :meth:`flush` at the end of the stream."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, chunk: str) -> str:
        text = self._pending + chunk
        self._pending = ""
        cut = _OPEN.search(text)
        if cut is not None and len(text) - cut.start() <= MAX_PENDING:
            text, self._pending = text[: cut.start()], text[cut.start() :]
        return strip_controls(text)

    def flush(self) -> str:
        """End of stream: an unterminated sequence is dropped (its introducer, at least)."""
        text, self._pending = self._pending, ""
        return strip_controls(text)
