"""The sandbox's side of egress and packages (``kernel-image/kernelhub_kernel``), pure
parts: what a resolution adds to the image, and the CA bundle the forwarder writes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

KERNEL_IMAGE = Path(__file__).resolve().parents[3] / "kernel-image"


@pytest.fixture(scope="module")
def kk() -> Iterator[object]:
    sys.path.insert(0, str(KERNEL_IMAGE))
    try:
        from kernelhub_kernel import egress, packages

        yield type("KK", (), {"packages": packages, "egress": egress})
    finally:
        sys.path.remove(str(KERNEL_IMAGE))


def test_only_what_the_image_lacks_is_installed(kk: object) -> None:
    packages = kk.packages  # type: ignore[attr-defined]
    resolved = packages.parse_pins(
        "# via uv\nnumpy==2.4.6\nkh-probe==1.0 ; python_version >= '3'\nScipy==1.17.1\n"
    )
    assert resolved == {"numpy": "2.4.6", "kh-probe": "1.0", "scipy": "1.17.1"}
    present = {"numpy": "2.4.6", "scipy": "1.0"}
    assert packages.missing(resolved, present) == ["kh-probe==1.0", "scipy==1.17.1"]


def test_sources_are_the_wheelhouses_and_no_index_unless_the_operator_set_one(
    kk: object,
) -> None:
    packages = kk.packages  # type: ignore[attr-defined]
    assert "--no-index" in packages.sources({})
    assert "--no-index" not in packages.sources({"UV_INDEX_URL": "https://mirror/simple"})


def test_the_session_site_is_in_the_workspace(kk: object) -> None:
    packages = kk.packages  # type: ignore[attr-defined]
    site = packages.site_dir({"KERNELHUB_WORKSPACE": "/w"})
    assert site == "/w/.kernelhub/site-packages"


def test_the_bundle_is_the_roots_then_the_operator_ca(
    kk: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    egress = kk.egress  # type: ignore[attr-defined]
    roots, ca = tmp_path / "roots.pem", tmp_path / "ca.pem"
    roots.write_bytes(b"ROOTS")
    ca.write_bytes(b"OPERATOR")
    monkeypatch.setattr(egress, "EGRESS_CA", str(ca))
    target = tmp_path / "t" / "bundle.pem"
    egress.write_bundle({"SSL_CERT_FILE": str(target)}, roots=(str(roots),))
    assert target.read_bytes() == b"ROOTS\nOPERATOR"
    egress.write_bundle({}, roots=(str(roots),))  # no SSL_CERT_FILE: nothing to write
