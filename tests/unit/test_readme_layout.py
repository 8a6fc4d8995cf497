"""The README's Layout section is the house as it is: one line per module, none missing,
none stale (issue #18). A module added without its line, or removed with its line left
behind, fails here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {
    "kernelhub/": REPO / "kernelhub",
    "kernel-image/kernelhub_kernel/": REPO / "kernel-image" / "kernelhub_kernel",
}


def _layout() -> dict[str, list[str]]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Layout") :]
    block = section[section.index("```") + 3 :]
    block = block[: block.index("```")]
    listed: dict[str, list[str]] = {}
    package: str | None = None
    for line in block.splitlines():
        if line in PACKAGES:
            package = line
            listed[package] = []
        elif not line.startswith("  "):
            package = None
        elif package is not None:
            match = re.match(r"  (\S+\.py)\s+\S", line)
            assert match, f"a Layout line without a module and its summary: {line!r}"
            listed[package].append(match.group(1))
    return listed


def _modules(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        # A near-empty __init__.py is a package marker, not a module worth a line.
        if not (p.name == "__init__.py" and len(p.read_text()) < 300)
    }


def test_every_module_has_exactly_one_layout_line_and_every_line_a_module() -> None:
    listed = _layout()
    assert set(listed) == set(PACKAGES), "the Layout names both packages"
    for name, root in PACKAGES.items():
        lines = listed[name]
        assert len(lines) == len(set(lines)), f"{name}: a module listed twice"
        actual = _modules(root)
        assert not actual - set(lines), f"{name}: modules missing from the Layout"
        assert not set(lines) - actual, f"{name}: Layout lines for modules that are gone"
