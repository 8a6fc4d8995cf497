"""A small, safe Markdown-to-HTML renderer for the HTML export. Pure: text in, HTML out.

It knows the subset the export writes and agents commonly use: ATX headings (``#``),
paragraphs, fenced code blocks, bullet and numbered lists, ``**bold**``, ``*italics*`` /
``_italics_``, ```code```, backslash escapes, and ``[links](url)``. Everything else is
text: every character that reaches the page is HTML-escaped, raw HTML included, and a link
becomes an ``<a>`` only for ``http``, ``https`` and ``mailto`` URLs (``javascript:``,
``data:`` and the rest are shown as their text, unlinked). The page's CSP still applies.

No library in the environment does this (markdown-it-py and mistune are not installed),
and a full CommonMark parser would be more code to trust than this subset needs.
"""

from __future__ import annotations

import html
import re
from urllib.parse import urlsplit

__all__ = ["render_markdown"]

SAFE_SCHEMES = frozenset({"http", "https", "mailto"})
_PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_BULLET = re.compile(r"^ {0,3}[-*+][ \t]+(.*)$")
_NUMBERED = re.compile(r"^ {0,3}\d{1,9}[.)][ \t]+(.*)$")
_LINK = re.compile(r"\[((?:\\.|[^\]\\])*)\]\(([^()\s]*)\)")


def render_markdown(text: str) -> str:
    """``text`` as HTML blocks: safe to put in a page as it is."""
    out: list[str] = []
    paragraph: list[str] = []
    items: list[str] = []
    list_tag = ""
    lines = text.splitlines()

    def flush() -> None:
        nonlocal list_tag
        if paragraph:
            out.append(f"<p>{_inline(chr(10).join(paragraph))}</p>")
            paragraph.clear()
        if items:
            body = "".join(f"<li>{_inline(item)}</li>" for item in items)
            out.append(f"<{list_tag}>{body}</{list_tag}>")
            items.clear()
            list_tag = ""

    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        fence = _FENCE.match(line)
        if fence:
            flush()
            code: list[str] = []
            while index < len(lines) and not lines[index].strip().startswith(fence.group(1)):
                code.append(lines[index])
                index += 1
            index += 1  # the closing fence (or the end of the text)
            out.append(f"<pre><code>{_e(chr(10).join(code))}</code></pre>")
            continue
        heading = _HEADING.match(line)
        if heading:
            flush()
            level = len(heading.group(1))
            out.append(f"<h{level}>{_inline(heading.group(2) or '')}</h{level}>")
            continue
        bullet, numbered = _BULLET.match(line), _NUMBERED.match(line)
        if bullet or numbered:
            tag = "ul" if bullet else "ol"
            if paragraph or (items and tag != list_tag):
                flush()
            list_tag = tag
            items.append((bullet or numbered).group(1))  # type: ignore[union-attr]
            continue
        if not line.strip():
            flush()
            continue
        if items and line.startswith((" ", "\t")):
            items[-1] += "\n" + line.strip()  # a list item's continuation line
            continue
        if items:
            flush()
        paragraph.append(line.strip())
    flush()
    return "\n".join(out)


def _inline(text: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\" and i + 1 < len(text) and text[i + 1] in _PUNCTUATION:
            out.append(_e(text[i + 1]))
            i += 2
            continue
        if char == "`":
            end = text.find("`", i + 1)
            if end > i + 1:
                out.append(f"<code>{_e(text[i + 1 : end])}</code>")
                i = end + 1
                continue
        if char == "_" and i > 0 and text[i - 1].isalnum():
            out.append(char)  # snake_case: no emphasis inside a word
            i += 1
            continue
        if text.startswith(("**", "__"), i):
            close = _closing(text, text[i : i + 2], i + 2)
            if close is not None:
                out.append(f"<strong>{_inline(text[i + 2 : close])}</strong>")
                i = close + 2
                continue
        if char in "*_":
            close = _closing(text, char, i + 1)
            if close is not None:
                out.append(f"<em>{_inline(text[i + 1 : close])}</em>")
                i = close + 1
                continue
        if char == "[":
            link = _LINK.match(text, i)
            if link is not None:
                label, url = _inline(link.group(1)), _unescape(link.group(2))
                if is_safe_url(url):
                    out.append(
                        f'<a href="{_e(url)}" rel="noopener noreferrer nofollow">{label}</a>'
                    )
                else:
                    out.append(label)  # shown, never followed
                i = link.end()
                continue
        out.append(_e(char))
        i += 1
    return "".join(out)


def _closing(text: str, delimiter: str, start: int) -> int | None:
    """Where ``delimiter`` closes a span opened just before ``start``: not escaped, not
    right after the opening, not after a space (``2 * 3 * 4`` stays text)."""
    if start >= len(text) or text[start].isspace():
        return None
    i = start
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == "`":  # a code span hides its contents
            end = text.find("`", i + 1)
            i = end + 1 if end > i else i + 1
            continue
        if text.startswith(delimiter, i) and i > start and not text[i - 1].isspace():
            after = text[i + len(delimiter) : i + len(delimiter) + 1]
            if delimiter[0] == "_" and after.isalnum():
                i += 1
                continue
            if len(delimiter) == 2 or not text.startswith(delimiter * 2, i):
                return i
            i += 2
            continue
        i += 1
    return None


def _unescape(text: str) -> str:
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", text)


def is_safe_url(url: str) -> bool:
    """Whether a link to ``url`` may be followed: an absolute http(s) or mailto URL with no
    control characters, spaces or backslashes (which browsers strip or reinterpret)."""
    if not url or any(ord(c) <= 0x20 or c in "\\\x7f" for c in url):
        return False
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    if parts.scheme.lower() not in SAFE_SCHEMES:
        return False
    return parts.scheme.lower() == "mailto" or bool(parts.netloc)


def _e(text: str) -> str:
    return html.escape(text, quote=True)
