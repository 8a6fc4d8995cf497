"""Notebook export end to end: a session with every kind of cell (plot, HTML, an error, an
interrupt, a timeout, an answered ``input()``), exported over REST and the CLI, validated,
rendered as HTML, and re-run with nbclient on a local ipykernel to reproduce its results.

Re-running: cells tagged ``kernelhub-skip-rerun`` (interrupted, timed out, asked for input)
cannot be reproduced and are removed first; a failed cell carries ``raises-exception``, so
nbclient expects its error."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest

from kernelhub.export import RERUN_SKIP_TAG
from tests.conftest import UNIT
from tests.gateway.conftest import Gateway

pytestmark = pytest.mark.docker

CELLS = {
    "first": "x = 21\nprint('x is', x)\nx * 2",
    "plot": "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('p')\nplt.show()",
    "html": "from IPython.display import HTML, display\n"
    "display(HTML('<b>bold</b><script>alert(1)</script>'))",
    "update": "h = display('first', display_id=True)\nh.update('second')\nprint('updated')",
    "error": "1 / 0",
    "interrupted": "import time\nprint('sleeping', flush=True)\ntime.sleep(60)",
    "timed_out": "time.sleep(60)",
    "input": "name = input('name? ')\nprint('hi', name)",
    "last": "print(x + 1)",
}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def finished(http: httpx.Client, token: str, eid: str, until: str | None = None) -> dict[str, Any]:
    """Poll an execution until it is final (or reaches status ``until``)."""
    deadline = time.monotonic() + 60 * UNIT
    while time.monotonic() < deadline:
        info = http.get(f"/v1/executions/{eid}", headers=auth(token)).json()
        if info["status"] == until or (until is None and info["record"] is not None):
            return dict(info)
        time.sleep(0.05)
    raise AssertionError(f"execution {eid} not {until or 'final'} in time: {info}")


def build_session(http: httpx.Client, token: str) -> str:
    r = http.post("/v1/sessions", json={}, headers=auth(token))
    assert r.status_code == 201, r.text
    sid = str(r.json()["id"])

    def submit(code: str, **extra: Any) -> str:
        r = http.post(
            f"/v1/sessions/{sid}/executions", json={"code": code, **extra}, headers=auth(token)
        )
        assert r.status_code in (200, 202), r.text
        return str(r.json()["id"])

    for name in ("first", "plot", "html", "update", "error"):
        submit(CELLS[name], wait=True)
    eid = submit(CELLS["interrupted"])
    finished(http, token, eid, until="running")
    deadline = time.monotonic() + 30 * UNIT
    while "sleeping" not in str(http.get(f"/v1/sessions/{sid}/notebook", headers=auth(token)).text):
        assert time.monotonic() < deadline, "the sleeping cell never printed"
        time.sleep(0.05)
    http.post(f"/v1/executions/{eid}/interrupt", headers=auth(token))
    assert finished(http, token, eid)["status"] == "interrupted"
    assert submit(CELLS["timed_out"], wait=True, timeout=2) and True
    eid = submit(CELLS["input"])
    finished(http, token, eid, until="awaiting_input")
    r = http.post(f"/v1/executions/{eid}/input", json={"value": "Ada"}, headers=auth(token))
    assert r.status_code == 202, r.text
    assert finished(http, token, eid)["status"] == "completed"
    submit(CELLS["last"], wait=True)
    return sid


def texts(cell: Any) -> list[Any]:
    """The deterministic text of a cell's outputs."""
    out: list[Any] = []
    for o in cell.outputs:
        if o.output_type == "stream":
            out.append((o.name, o.text))
        elif o.output_type == "execute_result":
            out.append(("result", o.data.get("text/plain")))
        elif o.output_type == "display_data":
            out.append(("display", o.data.get("text/html") or "image/png" in o.data))
        elif o.output_type == "error":
            out.append(("error", o.ename, o.evalue))
    return out


def test_export_validates_marks_and_reruns(gateway: Gateway, tmp_path: Path) -> None:
    alice, bob = gateway.token("alice"), gateway.token("bob")
    with httpx.Client(base_url=gateway.url, timeout=120 * UNIT) as http:
        sid = build_session(http, alice)
        r = http.get(f"/v1/sessions/{sid}/notebook", headers=auth(alice))
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ipynb+json"
        nb = nbformat.reads(r.text, as_version=4)
        page = http.get(f"/v1/sessions/{sid}/notebook?format=html", headers=auth(alice))
        for fmt in ("ipynb", "html"):
            denied = http.get(f"/v1/sessions/{sid}/notebook?format={fmt}", headers=auth(bob))
            assert denied.status_code == 404, denied.text
        assert (
            http.get(f"/v1/sessions/{sid}/notebook?format=pdf", headers=auth(alice)).status_code
            == 422
        )

    nbformat.validate(nb)
    assert nb.metadata.kernelhub["session_id"] == sid
    code = [c for c in nb.cells if c.cell_type == "code"]
    cells = dict(zip(CELLS, code, strict=True))
    assert [c.source for c in code] == list(CELLS.values())
    k = {name: c.metadata["kernelhub"] for name, c in cells.items()}

    assert texts(cells["first"]) == [("stdout", "x is 21\n"), ("result", "42")]
    assert k["first"]["status"] == "completed" and k["first"]["timings"]["duration"] > 0
    assert k["first"]["resources"]["output_bytes"] > 0
    assert [c.execution_count for c in code][:5] == [1, 2, 3, 4, 5]
    plot = cells["plot"].outputs[0]
    assert plot.output_type == "display_data" and plot.data["image/png"]
    assert "<script>alert(1)</script>" in cells["html"].outputs[0].data["text/html"]
    assert texts(cells["update"]) == [("display", False), ("stdout", "updated\n")]
    assert cells["update"].outputs[0].data["text/plain"] == "'second'"
    assert texts(cells["error"]) == [("error", "ZeroDivisionError", "division by zero")]
    assert cells["error"].metadata.tags == [RERUN_SKIP_TAG, "raises-exception"]

    def marker(name: str) -> str:
        return str(nb.cells[nb.cells.index(cells[name]) - 1].source)

    assert "failed" in marker("error")
    assert k["interrupted"]["status"] == "interrupted" and "interrupted" in marker("interrupted")
    assert cells["interrupted"].outputs[0].text == "sleeping\n"
    assert k["timed_out"]["status"] == "timed_out" and "timed out after" in marker("timed_out")
    assert cells["timed_out"].outputs[-1].text.startswith("[kernelhub: timed out after")
    assert k["input"]["inputs"] == [
        {"prompt": "name? ", "password": False, "value": "Ada", "answered_by": "alice"}
    ]
    for name in ("interrupted", "timed_out", "input"):
        assert RERUN_SKIP_TAG in cells[name].metadata.tags
    assert texts(cells["last"]) == [("stdout", "22\n")]

    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script" not in page.text.lower() and "Content-Security-Policy" in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    assert "data:image/png;base64," in page.text and "timed out" in page.text

    out = tmp_path / "exported.ipynb"
    gateway.cli("export", sid, "-o", str(out), "--url", gateway.url, "--token", alice)
    assert nbformat.read(out, as_version=4).cells[1].source == CELLS["first"]

    rerun(nb)


def rerun(nb: Any) -> None:
    import nbclient

    def kept(cell: Any) -> bool:
        tags = cell.metadata.get("tags", [])
        return cell.cell_type == "code" and (
            RERUN_SKIP_TAG not in tags or "raises-exception" in tags
        )

    expected = {c.id: texts(c) for c in nb.cells if kept(c)}
    nb.cells = [c for c in nb.cells if c.id in expected]
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=60).execute()
    assert len(expected) == 6
    for cell in nb.cells:
        assert texts(cell) == expected[cell.id], cell.source
