"""The export's markdown renderer, from data: the subset it knows, and hostile input that
must come out as inert text."""

from __future__ import annotations

import pytest

from kernelhub.export.markdown import is_safe_url, render_markdown


@pytest.mark.parametrize(
    ("source", "html"),
    [
        ("# kernelhub session `s1`", "<h1>kernelhub session <code>s1</code></h1>"),
        ("### three ###", "<h3>three</h3>"),
        (
            "**⚠ bold** and *it* and _it_",
            "<p><strong>⚠ bold</strong> and <em>it</em> and <em>it</em></p>",
        ),
        ("snake_case_name and 2 * 3 * 4", "<p>snake_case_name and 2 * 3 * 4</p>"),
        (r"escaped \*not\* \_it\_ \# \[x\]\(y\)", "<p>escaped *not* _it_ # [x](y)</p>"),
        ("- one\n- **two**\n  more", "<ul><li>one</li><li><strong>two</strong>\nmore</li></ul>"),
        ("1. a\n2) b", "<ol><li>a</li><li>b</li></ol>"),
        ("para\nline two\n\nnext", "<p>para\nline two</p>\n<p>next</p>"),
        (
            "```py\nx = '<b>' * 2\n```\nafter",
            "<pre><code>x = &#x27;&lt;b&gt;&#x27; * 2</code></pre>\n<p>after</p>",
        ),
        (
            "[docs](https://example.org/a?b=1&c=2)",
            '<p><a href="https://example.org/a?b=1&amp;c=2" rel="noopener noreferrer nofollow">docs</a></p>',
        ),
        (
            "[mail](mailto:a@example.org)",
            '<p><a href="mailto:a@example.org" rel="noopener noreferrer nofollow">mail</a></p>',
        ),
        ("`a ** b` **c**", "<p><code>a ** b</code> <strong>c</strong></p>"),
    ],
)
def test_the_subset_renders(source: str, html: str) -> None:
    assert render_markdown(source) == html


@pytest.mark.parametrize(
    "hostile",
    [
        "<script>alert(1)</script>",
        "# <img src=x onerror=alert(1)>",
        "**<iframe src=https://evil.example>**",
        "[click](javascript:alert(1))",
        "[click](javascript:alert`1`)",
        "[click](JaVaScRiPt:alert)",
        "[click](java\tscript:alert)",
        "[click](data:text/html;base64,PHNjcmlwdD4=)",
        "[click](vbscript:msgbox)",
        "[x](//evil.example/no-scheme)",
        '[x](https://ok.example/"onmouseover="alert(1))',
        "- <svg onload=alert(1)>",
        "```\n</code></pre><script>alert(1)</script>\n```",
        "`</code><script>x</script>`",
    ],
)
def test_hostile_input_comes_out_inert(hostile: str) -> None:
    out = render_markdown(hostile)
    assert "<script" not in out and "<img" not in out and "<iframe" not in out
    assert "<svg" not in out
    assert (
        'href="javascript' not in out.lower()
        and 'href="data' not in out
        and 'href="vbscript' not in out
    )
    assert 'href="//' not in out and '"onmouseover' not in out
    # Only the renderer's own tags appear: every '<' is one it wrote.
    tags = {t.split(">")[0].split(" ")[0] for t in out.split("<")[1:]}
    assert tags <= {
        "p",
        "/p",
        "h1",
        "/h1",
        "strong",
        "/strong",
        "ul",
        "/ul",
        "li",
        "/li",
        "pre",
        "/pre",
        "code",
        "/code",
        "a",
        "/a",
    }


def test_only_absolute_http_and_mailto_links_are_safe() -> None:
    assert (
        is_safe_url("https://example.org/x")
        and is_safe_url("http://a.b")
        and is_safe_url("mailto:x@y.z")
    )
    for url in (
        "javascript:alert(1)",
        "HTTPS:",
        "https://",
        "/relative",
        "#top",
        "ftp://x.y",
        "https://a b",
        "https:\\\\evil",
    ):
        assert not is_safe_url(url), url
