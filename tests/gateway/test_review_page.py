"""The review page end to end, in a real headless Chromium (Debian's, driven by the
``playwright`` package; no browser download) against one real gateway with Docker
sandboxes. An "agent" (httpx with a bearer token) runs cells; the browser, signed in by
cookie, watches, answers, steers and exports them. One gateway, one browser for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest

from tests.conftest import UNIT
from tests.gateway.conftest import Gateway, gateway_run_dir, remove_sandboxes

playwright_sync = pytest.importorskip("playwright.sync_api")
expect = playwright_sync.expect

pytestmark = pytest.mark.docker
CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
WAIT_MS = 60_000 * UNIT
expect.set_options(timeout=30_000 * UNIT)


def until(predicate: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout * UNIT
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout * UNIT:g} s")
        time.sleep(0.05)


class Agent:
    """The other client: runs cells over REST with its bearer token."""

    def __init__(self, gw: Gateway, token: str) -> None:
        self.http = httpx.Client(
            base_url=gw.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        )

    def session(self) -> str:
        r = self.http.post("/v1/sessions", json={})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def run(self, sid: str, code: str) -> str:
        r = self.http.post(f"/v1/sessions/{sid}/executions", json={"code": code})
        assert r.status_code == 202, r.text
        return str(r.json()["id"])

    def execution(self, eid: str) -> dict[str, Any]:
        return dict(self.http.get(f"/v1/executions/{eid}").json())

    def final(self, eid: str) -> dict[str, Any]:
        return dict(until(lambda: (info := self.execution(eid))["record"] and info))


class Tripwire:
    """A loopback endpoint hostile output would call; it must never be hit."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (apt-get install -y chromium)")
    base = tmp_path_factory.mktemp("review")
    gw = Gateway(base / "data", gateway_run_dir())
    gw.start()
    yield gw
    gw.stop()
    remove_sandboxes()


@pytest.fixture(scope="module")
def tokens(gw: Gateway) -> dict[str, str]:
    return {"alice": gw.token("alice"), "root": gw.token("root", admin=True)}


@pytest.fixture(scope="module")
def agent(gw: Gateway, tokens: dict[str, str]) -> Iterator[Agent]:
    a = Agent(gw, tokens["alice"])
    yield a
    a.http.close()


@pytest.fixture(scope="module")
def sid(agent: Agent) -> str:
    return agent.session()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield b
        b.close()


def sign_in(browser: Any, gw: Gateway, token: str) -> Any:
    context = browser.new_context(accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(gw.url + "/")
    page.fill("#token", token)
    page.click("#signin-form button[type=submit]")
    expect(page.locator("#whoami")).not_to_have_text("")
    return page


@pytest.fixture(scope="module")
def page(browser: Any, gw: Gateway, tokens: dict[str, str]) -> Iterator[Any]:
    page = sign_in(browser, gw, tokens["alice"])
    yield page
    page.context.close()


def open_session(page: Any, sid: str) -> None:
    page.goto(f"{page.url.split('#')[0]}#/session/{sid}")
    expect(page.locator("#s-conn")).to_have_text("live")


def test_sign_in_sets_a_strict_http_only_cookie_and_lists_sessions(
    page: Any, gw: Gateway, sid: str, tokens: dict[str, str]
) -> None:
    expect(page.locator("#whoami")).to_have_text("alice")
    expect(page.locator(f'#session-table tr[data-session="{sid}"]')).to_be_visible()
    cookies = {c["name"]: c for c in page.context.cookies()}
    session = cookies["kh_session"]
    assert session["httpOnly"] and session["sameSite"] == "Strict" and session["path"] == "/"
    assert 0 < session["expires"] - time.time() <= 8 * 3600 + 60
    assert tokens["alice"] not in session["value"] and tokens["alice"] not in page.url
    stored = page.evaluate(
        "JSON.stringify({...localStorage}) + JSON.stringify({...sessionStorage})"
    )
    assert tokens["alice"] not in stored
    # The page's CSP forbids inline script and framing.
    csp = httpx.get(gw.url + "/").headers["content-security-policy"]
    for part in ("default-src 'self'", "script-src 'self'", "object-src 'none'",
                 "frame-ancestors 'none'"):  # fmt: skip
        assert part in csp
    assert "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]


def test_lines_arrive_live_and_a_plot_renders(
    page: Any, agent: Agent, sid: str, tmp_path: Path
) -> None:
    open_session(page, sid)
    eid = agent.run(
        sid,
        "import sys, time\nfor i in range(3):\n    print(f'line {i}', flush=True)\n"
        "    time.sleep(0.6)\ninput('go on? ')\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()",
    )
    cell = page.locator(f'.cell[data-execution="{eid}"]')
    expect(cell.locator("pre.stdout")).to_contain_text("line 0")
    # Still running (waiting below) when the line showed: it came live, not at the end.
    assert agent.execution(eid)["record"] is None
    expect(cell.locator("pre.stdout")).to_contain_text("line 2")
    expect(cell.locator("pre.code")).to_contain_text("for i in range(3)")
    gate = page.locator(f'.gate[data-execution="{eid}"]')
    expect(gate).to_contain_text("go on?")
    gate.locator("input.answer-input").fill("yes")
    gate.locator("button.answer").click()
    img = cell.locator("img.image-output")
    expect(img).to_be_visible()
    assert img.evaluate("i => i.naturalWidth") > 0
    assert img.get_attribute("src").startswith("data:image/png;base64,")
    expect(cell.locator(".status")).to_have_text("completed")
    expect(cell.locator(".timing")).to_contain_text(" s")
    # The README's picture: refreshed with KERNELHUB_UPDATE_SCREENSHOT=1, else kept aside.
    shot = ROOT / "docs" / "review-page.png"
    if os.environ.get("KERNELHUB_UPDATE_SCREENSHOT") != "1":
        shot = tmp_path / "review-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


def test_confirms_approved_and_denied_and_an_input_answered(
    page: Any, agent: Agent, sid: str, tokens: dict[str, str], gw: Gateway
) -> None:
    open_session(page, sid)
    eid = agent.run(
        sid,
        "a = confirm('Delete file A?')\nb = confirm('Delete file B?')\n"
        "name = input('Your name? ')\nprint('answers', a, b, name)",
    )
    gate = page.locator(f'.gate[data-execution="{eid}"]')
    expect(gate).to_contain_text("Delete file A?")
    # Flagged in the session list too (the page polls it).
    assert agent.http.get(f"/v1/sessions/{sid}").json()["awaiting_input"] == eid
    gate.locator("button.approve").click()
    expect(gate).to_contain_text("Delete file B?")
    gate.locator("button.deny").click()
    expect(gate).to_contain_text("Your name?")
    gate.locator("input.answer-input").fill("Ada")
    gate.locator("button.answer").click()
    cell = page.locator(f'.cell[data-execution="{eid}"]')
    expect(cell.locator("pre.stdout")).to_contain_text("answers True False Ada")
    expect(gate).to_have_count(0)
    admin = httpx.get(
        f"{gw.url}/v1/admin/audit",
        params={"session_id": sid, "action": "execution.input"},
        headers={"Authorization": f"Bearer {tokens['root']}"},
    ).json()
    answers = [(e["principal"], json.loads(e["detail"])["value"]) for e in admin["entries"]]
    assert ("alice", "y") in answers and ("alice", "n") in answers
    assert ("alice", "Ada") in answers


def test_the_session_list_flags_a_waiting_gate(page: Any, agent: Agent, sid: str) -> None:
    eid = agent.run(sid, "input('waiting for a human')")
    page.goto(f"{page.url.split('#')[0]}#/sessions")
    row = page.locator(f'#session-table tr[data-session="{sid}"]')
    expect(row.locator(".gate-flag")).to_have_text("waiting for an answer")
    agent.http.post(f"/v1/executions/{eid}/input", json={"value": "x"})
    agent.final(eid)


def test_a_reconnect_replays_what_was_missed_without_gaps_or_repeats(
    page: Any, agent: Agent, sid: str
) -> None:
    open_session(page, sid)
    cells = page.locator(".cell")
    before = agent.run(sid, "print('before the cut')")
    expect(page.locator(f'.cell[data-execution="{before}"] .status')).to_have_text("completed")
    count = cells.count()
    # Cut the stream (and keep the page from reconnecting) while a cell runs and ends.
    page.evaluate("() => { state.view.closed = true; state.view.ws.close(); }")
    missed = agent.run(sid, "for i in range(5):\n    print('missed', i)")
    agent.final(missed)
    page.evaluate("() => { state.view.closed = false; connect(state.view); }")
    expect(page.locator("#s-conn")).to_have_text("live")
    cell = page.locator(f'.cell[data-execution="{missed}"]')
    expect(cell.locator(".status")).to_have_text("completed")
    text = cell.locator("pre.stdout").inner_text()
    assert text.split("\n")[:5] == [f"missed {i}" for i in range(5)]
    expect(cells).to_have_count(count + 1)  # nothing replayed twice
    assert (
        page.locator(f'.cell[data-execution="{before}"] pre.stdout')
        .inner_text()
        .count("before the cut")
        == 1
    )


def test_interrupt_a_running_cell_from_the_page(page: Any, agent: Agent, sid: str) -> None:
    open_session(page, sid)
    eid = agent.run(sid, "import time\nprint('sleeping', flush=True)\ntime.sleep(120)")
    cell = page.locator(f'.cell[data-execution="{eid}"]')
    expect(cell.locator("pre.stdout")).to_contain_text("sleeping")
    page.click("#c-interrupt")
    assert agent.final(eid)["status"] == "interrupted"
    expect(cell.locator(".status")).to_have_text("interrupted")
    expect(cell.locator("pre.traceback")).to_contain_text("KeyboardInterrupt")


def test_restart_and_pause_from_the_page_with_confirmation(
    page: Any, agent: Agent, sid: str
) -> None:
    open_session(page, sid)
    agent.final(agent.run(sid, "kept = 41"))
    page.once("dialog", lambda d: d.dismiss())  # "cancel": nothing happens
    page.click("#c-restart")
    assert agent.final(agent.run(sid, "kept + 1"))["record"]["status"] == "completed"
    page.once("dialog", lambda d: d.accept())
    page.click("#c-restart")
    expect(page.locator("#cells pre.notice").last).to_contain_text("kernel was restarted")
    after = agent.final(agent.run(sid, "kept"))
    assert after["record"]["error"]["name"] == "NameError"
    page.click("#c-pause")
    expect(page.locator("#s-state")).to_have_text("paused")
    page.click("#c-resume")
    expect(page.locator("#s-state")).to_have_text("ready")


def test_the_notebook_downloads_and_validates(page: Any, sid: str) -> None:
    open_session(page, sid)
    with page.expect_download() as download:
        page.click("#c-ipynb")
    nb = nbformat.reads(Path(download.value.path()).read_text(), as_version=4)
    nbformat.validate(nb)
    sources = "\n".join(c.source for c in nb.cells)
    assert "confirm('Delete file A?')" in sources


def test_hostile_html_output_never_runs_script(
    page: Any, agent: Agent, sid: str, gw: Gateway
) -> None:
    wire = Tripwire()
    httpx.get(wire.url + "/control")  # the tripwire works
    assert wire.hits == ["/control"]
    wire.hits.clear()
    hostile = (
        f"<img src=x onerror=\"window.parent.pwned=1;fetch('{wire.url}/img')\">"
        f"<script>window.parent.pwned=2;fetch('{wire.url}/script');"
        f"new Image().src='{wire.url}/beacon'</script>"
        f"<img src='{wire.url}/remote-image'><b class=bold>bold</b>"
    )
    open_session(page, sid)
    eid = agent.run(sid, f"from IPython.display import HTML, display\ndisplay(HTML({hostile!r}))")
    agent.final(eid)
    frame = page.locator(f'.cell[data-execution="{eid}"] iframe.html-output')
    expect(frame).to_have_count(1)
    expect(page.frame_locator(f'.cell[data-execution="{eid}"] iframe').locator("b")).to_have_text(
        "bold"
    )
    # Its images have loaded or failed, so the onerror handler would have run by now; and
    # a script that ran sets `pwned` before it fetches anything.
    frame.element_handle().content_frame().wait_for_load_state("load")
    assert page.evaluate("typeof window.pwned") == "undefined"
    assert frame.get_attribute("sandbox") == ""
    # Replayed from the store on a fresh page: still inert.
    page.reload()
    again = page.locator(f'.cell[data-execution="{eid}"] iframe.html-output')
    expect(again).to_have_count(1)
    again.element_handle().content_frame().wait_for_load_state("load")
    assert page.evaluate("typeof window.pwned") == "undefined"
    assert wire.hits == []
    wire.server.shutdown()
    wire.server.server_close()


def test_a_read_only_scoped_token_views_but_cannot_act(
    browser: Any, gw: Gateway, agent: Agent, sid: str, tokens: dict[str, str]
) -> None:
    other = agent.session()
    minted = httpx.post(
        f"{gw.url}/v1/admin/tokens",
        json={"name": "viewer", "read_only": True, "session_id": sid, "expires_in": 7200},
        headers={"Authorization": f"Bearer {tokens['root']}"},
    )
    assert minted.status_code == 201, minted.text
    viewer = sign_in(browser, gw, minted.json()["token"])
    try:
        expect(viewer.locator("#whoami")).to_contain_text("read-only")
        rows = viewer.locator("#session-table tbody tr")
        expect(rows).to_have_count(1)
        expect(viewer.locator(f'tr[data-session="{sid}"]')).to_be_visible()
        open_session(viewer, sid)
        expect(viewer.locator(".cell").first).to_be_visible()
        for button in ("#c-interrupt", "#c-pause", "#c-resume", "#c-restart", "#c-delete"):
            expect(viewer.locator(button)).to_be_disabled()
        eid = agent.run(sid, "input('ask the viewer')")
        gate = viewer.locator(f'.gate[data-execution="{eid}"]')
        expect(gate.locator("button.answer")).to_be_disabled()
        statuses = viewer.evaluate(
            """async ([sid, eid, other]) => {
              const csrf = document.cookie.match(/kh_csrf=([^;]+)/)[1];
              const h = {"Content-Type": "application/json", "X-CSRF-Token": csrf};
              const post = (p, b) => fetch(p, {method: "POST", headers: h, body: JSON.stringify(b)});
              return [
                (await post(`/v1/executions/${eid}/input`, {value: "y"})).status,
                (await post(`/v1/sessions/${sid}/executions`, {code: "1"})).status,
                (await fetch(`/v1/sessions/${sid}`, {method: "DELETE", headers: h})).status,
                (await fetch(`/v1/sessions/${other}`)).status,
                (await fetch(`/v1/sessions/${sid}/notebook`)).status,
              ];
            }""",
            [sid, eid, other],
        )
        assert statuses == [403, 403, 403, 404, 200]
        frame = viewer.evaluate(
            """(sid) => new Promise((resolve) => {
              const ws = new WebSocket(`ws://${location.host}/v1/sessions/${sid}/stream?since=999999`);
              ws.onopen = () => ws.send(JSON.stringify({type: "execute", code: "1", request_id: "r"}));
              ws.onmessage = (m) => { const f = JSON.parse(m.data);
                if (f.type === "error") { ws.close(); resolve(f); } };
            })""",
            sid,
        )
        assert frame["error"] == "forbidden" and "read-only" in frame["message"]
        agent.http.post(f"/v1/executions/{eid}/input", json={"value": "done"})
        agent.final(eid)
    finally:
        viewer.context.close()


def test_the_cli_mints_a_scoped_token(gw: Gateway, sid: str) -> None:
    token = gw.cli(
        "token", "create", "--name", "cli-viewer", "--read-only", "--session", sid,
        "--expires", "2h",
    )  # fmt: skip
    me = httpx.get(f"{gw.url}/v1/whoami", headers={"Authorization": f"Bearer {token}"}).json()
    assert (me["name"], me["token"], me["read_only"], me["session_id"]) == (
        "alice",
        "cli-viewer",
        True,
        sid,
    )
    left = datetime.fromisoformat(me["expires_at"]) - datetime.now(UTC)
    assert timedelta(hours=1, minutes=59) < left <= timedelta(hours=2)
    # The other doors that run code do not half-honour a scope: they refuse it.
    jupyter = httpx.get(f"{gw.url}/api/kernels", headers={"Authorization": f"token {token}"})
    assert jupyter.status_code == 403 and "scoped" in jupyter.text, jupyter.text
    e2b = httpx.get(f"{gw.url}/e2b/sandboxes", headers={"X-API-Key": token})
    assert e2b.status_code == 403 and "scoped" in e2b.text, e2b.text
    listed = gw.cli("token", "list")
    assert "cli-viewer" in listed
    with pytest.raises(subprocess.CalledProcessError) as refused:
        gw.cli("token", "create", "--name", "x", "--session", "nope")
    assert "no session 'nope'" in refused.value.stderr


def test_cookie_requests_that_change_something_need_the_csrf_token(page: Any, sid: str) -> None:
    status = page.evaluate(
        """async (sid) => (await fetch(`/v1/sessions/${sid}/pause`, {method: "POST"})).status""",
        sid,
    )
    assert status == 403


def test_an_expired_token_is_refused(browser: Any, gw: Gateway) -> None:
    token = gw.cli("token", "create", "--name", "brief", "--expires", "1s")
    refused = until(
        lambda: (
            (
                r := httpx.get(f"{gw.url}/v1/whoami", headers={"Authorization": f"Bearer {token}"})
            ).status_code
            == 401
            and r
        )
    )
    assert "expired at" in refused.json()["message"]
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(gw.url + "/")
        page.fill("#token", token)
        page.click("#signin-form button[type=submit]")
        expect(page.locator("#flash")).to_contain_text("expired at")
        expect(page.locator("#signin")).to_be_visible()
        assert not [c for c in context.cookies() if c["name"] == "kh_session"]
    finally:
        context.close()


def test_sign_out_ends_the_cookie(browser: Any, gw: Gateway, tokens: dict[str, str]) -> None:
    page = sign_in(browser, gw, tokens["alice"])
    try:
        sid_cookie = next(c for c in page.context.cookies() if c["name"] == "kh_session")
        page.click("#signout")
        expect(page.locator("#signin")).to_be_visible()
        r = httpx.get(f"{gw.url}/v1/whoami", cookies={"kh_session": sid_cookie["value"]})
        assert r.status_code == 401
    finally:
        page.context.close()


def test_an_admin_sees_everyone_reads_the_audit_log_and_stops_all(
    browser: Any, gw: Gateway, agent: Agent, sid: str, tokens: dict[str, str]
) -> None:
    """Last: it stops every session."""
    admin = sign_in(browser, gw, tokens["root"])
    try:
        row = admin.locator(f'#session-table tr[data-session="{sid}"]')
        expect(row).to_contain_text("alice")  # someone else's, with its owner
        expect(row.locator(".usage")).to_contain_text("KiB stored")
        admin.fill("#f-owner", "nobody")
        expect(row).to_have_count(0)
        admin.fill("#f-owner", "ali")
        expect(row).to_have_count(1)
        admin.click("#nav-audit")
        admin.fill("#a-action", "session.restart")
        admin.click("#a-search")
        rows = admin.locator("#audit-table tbody tr")
        expect(rows.first).to_contain_text("session.restart")
        assert all("session.restart" in t for t in rows.all_inner_texts())
        admin.fill("#a-action", "")
        admin.fill("#a-text", "Delete file A?")
        admin.click("#a-search")
        expect(rows.first).to_contain_text("confirm('Delete file A?')")
        admin.once("dialog", lambda d: d.accept())
        admin.click("#stop-all")
        expect(admin.locator("#flash")).to_contain_text("stopped")
        assert agent.http.get(f"/v1/sessions/{sid}").status_code == 410
    finally:
        admin.context.close()
