"""The sandbox's ``pip`` (``kernelhub_kernel/packages.py``): its command line, the names
it normalizes, the session's package directory found by a real import, and what it
records; uv itself is exercised in tests/docker."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.kernel_image.loader import load

packages = load("packages")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], bool]]:
    """What ``main`` asks ``install`` for (uv is not on the host)."""
    seen: list[tuple[list[str], bool]] = []

    def install(requirements: list[str], *, quiet: bool = False) -> int:
        seen.append((list(requirements), quiet))
        return 7

    monkeypatch.setattr(packages, "install", install)
    return seen


@pytest.mark.parametrize(
    ("argv", "names", "quiet"),
    [
        (["install", "numpy"], ["numpy"], False),
        (["install", "-q", "a", "b==1.0"], ["a", "b==1.0"], True),
        (["install", "--quiet", "--upgrade", "c[extra]"], ["c[extra]"], True),
        (["install"], [], False),
    ],
)
def test_install_takes_the_names_and_drops_the_flags(
    calls: list[tuple[list[str], bool]], argv: list[str], names: list[str], quiet: bool
) -> None:
    assert packages.main(argv) == 7
    assert calls == [(names, quiet)]


def test_pip_magic_is_the_same_command_line(calls: list[tuple[list[str], bool]]) -> None:
    packages.pip_magic("install -q tqdm")
    assert calls == [(["tqdm"], True)]


@pytest.mark.parametrize("argv", [[], ["uninstall", "x"], ["download", "x"]])
def test_anything_else_is_refused_with_what_is_supported(
    argv: list[str], calls: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert packages.main(argv) == 2
    assert "pip install NAME, pip list" in capsys.readouterr().err
    assert calls == []


def test_install_of_nothing_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert packages.install([]) == 2
    assert "usage: pip install NAME" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "normal"),
    [("Scikit_Learn", "scikit-learn"), ("zope.interface", "zope-interface"), ("a--_.b", "a-b")],
)
def test_names_are_normalized_as_pep_503_says(name: str, normal: str) -> None:
    assert packages.normalize(name) == normal


def test_parse_pins_ignores_comments_extras_and_markers() -> None:
    text = "pkg[extra]==2.0  # via x\n  # only a comment\nother>=1\nlast==3 ; os_name == 'nt'\n"
    assert packages.parse_pins(text) == {"pkg": "2.0", "last": "3"}


def _dist(site: Path, name: str, version: str, module: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (site / f"{module}.py").write_text(f"VALUE = {version!r}\n")


@pytest.fixture
def session_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(packages.WORKSPACE_ENV, str(tmp_path))
    saved_path, saved_meta = list(sys.path), list(sys.meta_path)
    yield Path(packages.site_dir())
    sys.path[:], sys.meta_path[:] = saved_path, saved_meta
    for name in [n for n in sys.modules if n.startswith("kh_t3_probe")]:
        del sys.modules[name]


def test_a_package_installed_after_activation_is_importable(session_site: Path) -> None:
    path = packages.activate()
    assert path == str(session_site)
    assert path not in sys.path  # no directory yet: the workspace stays as it was
    with pytest.raises(ImportError):
        importlib.import_module("kh_t3_probe_late")
    _dist(session_site, "KH_T3_Probe", "1.2", "kh_t3_probe_late")
    assert importlib.import_module("kh_t3_probe_late").VALUE == "1.2"
    assert sys.path[-1] == path  # after the image's: it never shadows
    assert packages._installed(str(session_site)) == {"kh-t3-probe": "1.2"}


def test_an_existing_session_site_goes_on_the_path_at_activation(session_site: Path) -> None:
    _dist(session_site, "kh_t3_probe_early", "0.1", "kh_t3_probe_early")
    path = packages.activate()
    assert path in sys.path
    assert importlib.import_module("kh_t3_probe_early").VALUE == "0.1"


def test_what_was_asked_and_installed_is_recorded(session_site: Path) -> None:
    session_site.mkdir(parents=True)
    packages._record(["tqdm", "rich>=13"], ["tqdm==4.0", "rich==13.1"])
    packages._record(["six"], ["six==1.16"])
    text = (session_site.parent / "requirements.txt").read_text()
    assert text == (
        "# pip install tqdm rich>=13\ntqdm==4.0\nrich==13.1\n# pip install six\nsix==1.16\n"
    )
    assert packages._installed(str(session_site / "absent")) == {}


def test_list_shows_the_image_and_the_session(
    session_site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _dist(session_site, "kh_t3_probe_listed", "9.9", "kh_t3_probe_listed")
    assert packages.main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "kh-t3-probe-listed==9.9" in out
    names = [line.partition("==")[0] for line in out]
    assert names == sorted(names) and len(names) > 1
