"""Every notebook in notebooks/ runs, top to bottom and without a cell error, against a
real gateway. The kernel nbclient starts inherits this process's environment, which is
how the notebooks get ``KERNELHUB_URL`` and ``KERNELHUB_TOKEN``."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest

from tests.conftest import UNIT
from tests.gateway.conftest import Gateway

pytestmark = pytest.mark.docker

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert {p.stem for p in NOTEBOOKS} >= {
        "quickstart", "data_analysis", "pause_and_confirm", "snapshot_and_resume",
    }  # fmt: skip


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(
    path: Path, gateway: Gateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbclient

    monkeypatch.setenv("KERNELHUB_URL", gateway.url)
    monkeypatch.setenv("KERNELHUB_TOKEN", gateway.token("notebooks"))
    nb = nbformat.read(path, as_version=4)
    started = time.monotonic()
    nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=60 * UNIT,
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()  # raises CellExecutionError on the first failing cell
    assert time.monotonic() - started < 20 * UNIT, "keep each notebook fast"
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert errors == []
