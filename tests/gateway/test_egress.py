"""Egress by policy, end to end: a real gateway, real Docker sandboxes (still
``--network none``), the proxy on the session's Unix socket, and "the internet" on
127.0.0.1 (tests/egress_net.py): an HTTPS server signed by a test CA for ``*.good.test``
names, reached through pinned upstreams, and a DNS server for names that resolve into
loopback and private ranges."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import docker
import httpx
import pytest

from kernelhub.config import DockerSettings
from tests.conftest import RUN_INSTANCE, UNIT
from tests.egress_net import Seen, dns_server, https_server, make_ca, make_wheel, simple_index
from tests.gateway.conftest import Gateway, gateway_run_dir, remove_sandboxes

pytestmark = pytest.mark.docker

SECRET = "kh-test-secret-7f3a9c"
IMAGE = os.environ.get("KERNELHUB_DOCKER__IMAGE", DockerSettings().image)
PROXY = "('127.0.0.1', int(__import__('os').environ['KERNELHUB_EGRESS_PORT']))"


class Net:
    def __init__(self, gateway: Gateway, seen: Seen, plain_seen: Seen) -> None:
        self.gateway = gateway
        self.seen = seen
        self.plain_seen = plain_seen
        self.admin = gateway.token("root", admin=True)
        self.user = gateway.token("alice")
        self.bot = gateway.token("bot")


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    root = tmp_path_factory.mktemp("egress")
    ca = make_ca(root / "ca")
    wheelhouse = root / "wheelhouse"
    make_wheel(wheelhouse, "kh_egress_probe", "1.2.3", "def hello():\n    return 'probe ok'\n")
    mirrored = make_wheel(root / "mirror", "kh_mirror_probe", "0.1", "VALUE = 'from the mirror'\n")
    with (
        https_server(ca, root, simple_index([mirrored])) as (port, seen),
        https_server(None, root) as (plain_port, plain_seen),
        dns_server({"evil.good.test": "127.0.0.1", "ten.good.test": "10.1.2.3"}) as dns_port,
    ):
        upstream = f"127.0.0.1:{port}"
        policies = {
            "test": {
                "allow": [
                    "api.good.test", "secret.good.test", "flood.good.test",
                    "evil.good.test", "ten.good.test", "pypi.good.test",
                    "plain.good.test",
                ],
                "quota_bytes": 4_000_000,
                "headers": {
                    "secret.good.test": {"X-Api-Key": SECRET},
                    "plain.good.test": {"X-Api-Key": SECRET},
                },
            },
            "strict": {"allow": ["api.good.test"], "ask": False},
        }  # fmt: skip
        pins = {
            name: upstream
            for name in (
                "api.good.test",
                "secret.good.test",
                "flood.good.test",
                "ask.good.test",
                "wsask.good.test",
                "pypi.good.test",
            )
        }
        pins["plain.good.test"] = f"127.0.0.1:{plain_port}"
        gw = Gateway(
            root / "data",
            gateway_run_dir(),
            KERNELHUB_DOCKER__IMAGE=IMAGE,
            KERNELHUB_EGRESS__POLICIES=json.dumps(policies),
            KERNELHUB_EGRESS__DEFAULT_POLICY="test",
            KERNELHUB_EGRESS__ALLOWED_POLICIES=json.dumps({"*": ["strict"]}),
            KERNELHUB_EGRESS__HOSTS=json.dumps(pins),
            KERNELHUB_EGRESS__NAMESERVER=f"127.0.0.1:{dns_port}",
            KERNELHUB_EGRESS__CA_CERT_FILE=str(ca.cert_file),
            KERNELHUB_EGRESS__CA_KEY_FILE=str(ca.key_file),
            KERNELHUB_EGRESS__UPSTREAM_CA_FILE=str(ca.cert_file),
            KERNELHUB_EGRESS__WHEELHOUSE=str(wheelhouse),
            KERNELHUB_EGRESS__INDEX_URL="https://pypi.good.test/simple",
            KERNELHUB_LIMITS__INPUT_TIMEOUT="120",
            KERNELHUB_PROFILES__TIERS=json.dumps(
                {
                    "tight": {
                        "isolation": "docker",
                        "limits": {"memory_bytes": 256 * 2**20, "cpus": 0.5},
                        "egress": "strict",
                    },
                    "untrusted": {"isolation": "gvisor"},
                }
            ),
            KERNELHUB_PROFILES__TOKENS=json.dumps({"bot": ["tight"]}),
        )
        gw.start()
        try:
            yield Net(gw, seen, plain_seen)
        finally:
            gw.stop()
            remove_sandboxes()


@pytest.fixture
async def http(net: Net) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=net.gateway.url,
        timeout=120 * UNIT,
        headers={"Authorization": f"Bearer {net.user}"},
    ) as client:
        yield client
        # Each test's sessions go with it: the sandboxes are the machine's scarce part.
        for session in (await client.get("/v1/sessions")).json()["sessions"]:
            await client.delete(f"/v1/sessions/{session['id']}")


async def new_session(http: httpx.AsyncClient, **body: Any) -> str:
    r = await http.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def run(http: httpx.AsyncClient, sid: str, code: str) -> str:
    r = await http.post(f"/v1/sessions/{sid}/executions", json={"code": code, "wait": True})
    assert r.status_code == 200, r.text
    return text_of(r.json())


def text_of(execution: dict[str, Any]) -> str:
    out = []
    for e in execution["events"]:
        if e["type"] == "stream":
            out.append(e["text"])
        elif e["type"] == "error":
            out.append(f"{e['error']['name']}: {e['error']['value']}")
    return "".join(out)


async def audit(net: Net, sid: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=net.gateway.url, timeout=30 * UNIT) as client:
        r = await client.get(
            "/v1/admin/audit",
            params={"session_id": sid, "limit": 1000},
            headers={"Authorization": f"Bearer {net.admin}"},
        )
    assert r.status_code == 200, r.text
    entries = list(r.json()["entries"])
    for e in entries:
        if isinstance(e.get("detail"), str):
            e["detail"] = json.loads(e["detail"])
        e["detail"] = e.get("detail") or {}
    return entries


async def until_awaiting_input(http: httpx.AsyncClient, eid: str) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + 60 * UNIT
    while True:
        info = dict((await http.get(f"/v1/executions/{eid}")).json())
        if info["status"] == "awaiting_input":
            return info
        assert info["record"] is None, f"finished without asking: {text_of(info)}"
        assert asyncio.get_running_loop().time() < deadline, "never asked"
        await asyncio.sleep(0.05)


async def until_finished(http: httpx.AsyncClient, eid: str) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + 60 * UNIT
    while True:
        info = dict((await http.get(f"/v1/executions/{eid}")).json())
        if info["record"] is not None:
            return info
        assert asyncio.get_running_loop().time() < deadline, "never finished"
        await asyncio.sleep(0.05)


async def test_an_allowed_domain_works_from_urllib_and_requests(
    net: Net, http: httpx.AsyncClient
) -> None:
    sid = await new_session(http)
    out = await run(
        http,
        sid,
        "import urllib.request, requests\n"
        "print(urllib.request.urlopen('https://api.good.test/from-urllib').read().decode())\n"
        "print(requests.get('https://api.good.test/from-requests', timeout=30).text)\n",
    )
    assert "hello from api.good.test /from-urllib" in out, out
    assert "hello from api.good.test /from-requests" in out, out
    # Still no network of its own: only loopback exists in the sandbox.
    out = await run(http, sid, "import socket; print(socket.if_nameindex())")
    assert "'lo'" in out and "eth" not in out, out


CONNECT = f"""
import socket, ssl
def connect(target, sni=None):
    s = socket.create_connection({PROXY})
    s.sendall(f"CONNECT {{target}} HTTP/1.1\\r\\nHost: {{target}}\\r\\n\\r\\n".encode())
    head = s.recv(4096).decode(errors="replace").split("\\r\\n")[0]
    if sni is None or " 200 " not in head:
        return head
    ctx = ssl.create_default_context()
    try:
        with ctx.wrap_socket(s, server_hostname=sni) as t:
            return "tls ok " + t.version()
    except (OSError, ssl.SSLError) as exc:
        return f"tls refused: {{type(exc).__name__}}"
"""


async def test_ip_literals_private_answers_and_a_wrong_sni_are_refused(
    net: Net, http: httpx.AsyncClient
) -> None:
    sid = await new_session(http)
    port = net.gateway.env["KERNELHUB_EGRESS__HOSTS"]
    literal = json.loads(port)["api.good.test"]  # the real server's loopback address
    out = await run(
        http,
        sid,
        CONNECT + f"print('literal:', connect({literal!r}))\n"
        "print('v6:', connect('[::1]:443'))\n"
        "print('decimal:', connect('2130706433:443'))\n"
        "print('loopback dns:', connect('evil.good.test:443'))\n"
        "print('private dns:', connect('ten.good.test:443'))\n"
        "print('right sni:', connect('api.good.test:443', sni='api.good.test'))\n"
        "print('wrong sni:', connect('api.good.test:443', sni='other.good.test'))\n",
    )
    lines = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert lines["literal"].startswith("HTTP/1.1 403") and "IP address" in lines["literal"]
    assert lines["v6"].startswith("HTTP/1.1 403") and "IP address" in lines["v6"]
    assert lines["decimal"].startswith("HTTP/1.1 403") and "numeric" in lines["decimal"]
    assert "403" in lines["loopback dns"] and "127.0.0.1 is loopback" in lines["loopback dns"]
    assert "403" in lines["private dns"] and "10.1.2.3 is private" in lines["private dns"]
    assert lines["right sni"].startswith("tls ok"), out
    assert lines["wrong sni"].startswith("tls refused"), out
    reasons = [
        e["detail"].get("reason", "") for e in await audit(net, sid) if e["action"] == "egress.deny"
    ]
    assert any("TLS server name 'other.good.test' is not api.good.test" in r for r in reasons)


async def test_a_domain_off_a_strict_policy_fails_with_a_clear_error(
    net: Net, http: httpx.AsyncClient
) -> None:
    sid = await new_session(http, egress="strict")
    out = await run(
        http,
        sid,
        "import urllib.request\n"
        "try:\n"
        "    urllib.request.urlopen('https://secret.good.test/x')\n"
        "except OSError as exc:\n"
        "    print('refused:', exc)\n",
    )
    assert "refused:" in out and "secret.good.test:443 is not on policy 'strict'" in out, out
    r = await http.post("/v1/sessions", json={"egress": "nonesuch"})
    assert r.status_code == 403 and "KERNELHUB_EGRESS__ALLOWED_POLICIES" in r.text, r.text


async def test_an_unknown_domain_waits_for_a_human_answered_through_the_api(
    net: Net, http: httpx.AsyncClient
) -> None:
    sid = await new_session(http)
    code = "import requests\nprint(requests.get('https://ask.good.test/asked', timeout=90).text)\n"
    r = await http.post(f"/v1/sessions/{sid}/executions", json={"code": code})
    eid = r.json()["id"]
    await until_awaiting_input(http, eid)
    assert (await http.get(f"/v1/sessions/{sid}")).json()["awaiting_input"] == eid
    r = await http.post(f"/v1/executions/{eid}/input", json={"value": "session"})
    assert r.status_code == 202, r.text
    info = await until_finished(http, eid)
    assert "hello from ask.good.test /asked" in text_of(info), text_of(info)
    prompts = [e["prompt"] for e in info["events"] if e["type"] == "input_request"]
    assert len(prompts) == 1 and "ask.good.test:443 for this session?" in prompts[0], prompts
    # "for this session": the next request goes without asking.
    out = await run(http, sid, code.replace("/asked", "/again"))
    assert "hello from ask.good.test /again" in out, out
    # Deny: a clear error in the cell, and it stays denied.
    r = await http.post(
        f"/v1/sessions/{sid}/executions",
        json={
            "code": "import urllib.request\ntry:\n    urllib.request.urlopen("
            "'https://nope.good.test/')\nexcept OSError as exc:\n    print('refused:', exc)\n"
        },
    )
    eid2 = r.json()["id"]
    await until_awaiting_input(http, eid2)
    await http.post(f"/v1/executions/{eid2}/input", json={"value": "deny"})
    out = text_of(await until_finished(http, eid2))
    assert "refused:" in out and "denied by a human" in out, out
    entries = await audit(net, sid)
    answers = [
        (e["detail"]["host"], e["detail"]["answer"])
        for e in entries
        if e["action"] == "egress.answer"
    ]
    assert sorted(answers) == [("ask.good.test", "session"), ("nope.good.test", "deny")]
    assert sum(e["action"] == "egress.ask" for e in entries) == 2
    assert {e["detail"]["value"] for e in entries if e["action"] == "execution.input"} == {
        "session",
        "deny",
    }


async def test_the_injected_header_reaches_the_server_and_never_the_sandbox(
    net: Net, http: httpx.AsyncClient
) -> None:
    sid = await new_session(http)
    before = len(net.seen.requests)
    out = await run(
        http,
        sid,
        "import os, requests, pathlib\n"
        "r = requests.get('https://secret.good.test/with-key', timeout=30)\n"
        "print(r.status_code, r.text, dict(r.headers), r.request.headers)\n"
        "print(dict(os.environ))\n"
        "for root in ('/run/kernelhub', '/tmp', '/workspace'):\n"
        "    for p in pathlib.Path(root).rglob('*'):\n"
        "        if p.is_file() and not p.is_socket():\n"
        "            try: print(p, p.read_bytes()[:100000])\n"
        "            except OSError: pass\n",
    )
    assert "200 hello from secret.good.test /with-key" in out, out
    got = [h for host, path, h in net.seen.requests[before:] if path == "/with-key"]
    assert got and got[0].get("x-api-key") == SECRET
    assert SECRET not in out
    # Plain HTTP (an absolute-URI proxy request) gets it too, forged copies dropped.
    out = await run(
        http,
        sid,
        "import urllib.request\n"
        "req = urllib.request.Request('http://plain.good.test/plain', headers={'X-Api-Key': 'forged'})\n"
        "print(urllib.request.urlopen(req).read().decode())\n",
    )
    assert "hello from plain.good.test /plain" in out, out
    got = [h for _, path, h in net.plain_seen.requests if path == "/plain"]
    assert got and got[-1].get("x-api-key") == SECRET and "forged" not in str(got[-1])
    client = docker.from_env()
    try:
        (container,) = client.containers.list(filters={"label": f"org.kernelhub.session={sid}"})
        assert SECRET not in json.dumps(container.attrs)
    finally:
        client.close()


async def test_pip_install_from_the_wheelhouse_survives_snapshot_and_restore(
    http: httpx.AsyncClient,
) -> None:
    sid = await new_session(http)
    out = await run(
        http,
        sid,
        "%pip install kh_egress_probe\nimport kh_egress_probe\nprint(kh_egress_probe.hello())",
    )
    assert "probe ok" in out, out
    out = await run(http, sid, "!pip install kh-egress-probe\n!pip list | grep probe")
    assert "already satisfied" in out and "kh-egress-probe==1.2.3" in out, out
    r = await http.post(f"/v1/sessions/{sid}/snapshots")
    assert r.status_code == 201, r.text
    restored = await new_session(http, from_snapshot=r.json()["id"])
    out = await run(http, restored, "import kh_egress_probe\nprint(kh_egress_probe.hello())")
    assert "probe ok" in out, out
    r = await http.post(
        f"/v1/sessions/{sid}/executions", json={"code": "%pip install nonesuch-pkg", "wait": True}
    )
    assert "nonesuch-pkg" in text_of(r.json()), text_of(r.json())


async def test_the_egress_quota_cuts_a_flood(net: Net, http: httpx.AsyncClient) -> None:
    sid = await new_session(http)
    out = await run(
        http,
        sid,
        "import requests\n"
        "try:\n"
        "    r = requests.get('https://flood.good.test/flood/50000000', timeout=60)\n"
        "    print('got', len(r.content))\n"
        "except requests.RequestException as exc:\n"
        "    print('cut:', type(exc).__name__)\n"
        "try:\n"
        "    requests.get('https://api.good.test/after', timeout=30)\n"
        "except requests.RequestException as exc:\n"
        "    print('after:', exc)\n",
    )
    assert "cut:" in out and "got" not in out, out
    assert "quota" in out.split("after:", 1)[1], out
    quota = [e for e in await audit(net, sid) if e["action"] == "egress.quota"]
    assert len(quota) == 1 and quota[0]["detail"]["used_bytes"] < 4_000_000 + 1_000_000


async def test_a_token_restricted_to_a_trust_tier_gets_its_isolation_limits_and_egress(
    net: Net, http: httpx.AsyncClient
) -> None:
    async with httpx.AsyncClient(
        base_url=net.gateway.url,
        timeout=120 * UNIT,
        headers={"Authorization": f"Bearer {net.bot}"},
    ) as bot:
        sid = await new_session(bot)
        client = docker.from_env()
        try:
            (container,) = client.containers.list(filters={"label": f"org.kernelhub.session={sid}"})
            host = container.attrs["HostConfig"]
            assert host["Memory"] == 256 * 2**20 and host["NanoCpus"] == 5 * 10**8
            assert host["Runtime"] == "runc" and host["NetworkMode"] == "none"
        finally:
            client.close()
        out = await run(
            bot,
            sid,
            "import requests\n"
            "print(requests.get('https://api.good.test/tier', timeout=30).text)\n"
            "try:\n    requests.get('https://secret.good.test/', timeout=30)\n"
            "except requests.RequestException as exc:\n    print('refused:', exc)\n",
        )
        assert "hello from api.good.test /tier" in out, out
        assert "not on policy 'strict'" in out, out
        r = await bot.post("/v1/sessions", json={"profile": "untrusted"})
        assert r.status_code == 403 and "KERNELHUB_PROFILES__TOKENS" in r.text, r.text
        r = await bot.post("/v1/sessions", json={"egress": "test"})
        assert r.status_code == 403 and "fixes its egress policy" in r.text, r.text
        r = await bot.post("/v1/sessions", json={"limits": {"memory_bytes": 512 * 2**20}})
        assert r.status_code == 400 and "above the maximum" in r.text, r.text
    # gVisor where installed: this daemon has no runsc, and the refusal says so.
    r = await http.post("/v1/sessions", json={"profile": "untrusted"})
    if r.status_code == 201:
        sid = r.json()["id"]
        client = docker.from_env()
        try:
            (container,) = client.containers.list(filters={"label": f"org.kernelhub.session={sid}"})
            assert container.attrs["HostConfig"]["Runtime"] == "runsc"
        finally:
            client.close()
    else:
        assert r.status_code == 400 and "runsc" in r.text, r.text


async def test_pip_install_from_the_operators_mirror_goes_through_the_proxy(
    net: Net, http: httpx.AsyncClient
) -> None:
    sid = await new_session(http)
    before = len(net.seen.requests)
    out = await run(
        http,
        sid,
        "%pip install kh-mirror-probe\nimport kh_mirror_probe\nprint(kh_mirror_probe.VALUE)",
    )
    assert "from the mirror" in out, out
    fetched = [path for _, path, _ in net.seen.requests[before:]]
    assert "/simple/kh-mirror-probe/" in fetched and any(p.startswith("/files/") for p in fetched)
    # The same policy applies: a session whose policy lacks the mirror cannot reach it.
    strict = await new_session(http, egress="strict")
    out = await run(http, strict, "%pip install kh-mirror-probe\nimport kh_mirror_probe")
    assert "No module named 'kh_mirror_probe'" in out, out
    denied = [e["detail"] for e in await audit(net, strict) if e["action"] == "egress.deny"]
    assert any(d.get("host") == "pypi.good.test" for d in denied), denied


async def test_the_gate_is_answered_over_the_websocket_like_confirm(
    net: Net, http: httpx.AsyncClient
) -> None:
    from websockets.asyncio.client import connect

    sid = await new_session(http)
    url = f"{net.gateway.ws_url}/v1/sessions/{sid}/stream"
    code = (
        "import requests\nprint(requests.get('https://wsask.good.test/', timeout=90).status_code)"
    )
    async with connect(url, additional_headers={"Authorization": f"Bearer {net.user}"}) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        await ws.send(json.dumps({"type": "execute", "code": code, "request_id": "r1"}))
        prompt, printed, frames = None, "", []
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60 * UNIT))
            frames.append(frame)
            event = frame.get("event") or {}
            if event.get("type") == "input_request":
                prompt = event["prompt"]
                await ws.send(
                    json.dumps(
                        {
                            "type": "input_reply",
                            "execution_id": event["execution_id"],
                            "value": "once",
                        }
                    )
                )
            elif event.get("type") == "stream":
                printed += event["text"]
            elif event.get("type") == "final":
                break
    assert prompt is not None and "wsask.good.test:443" in prompt
    assert printed.strip() == "200", frames


async def test_a_sessions_tier_policy_and_answers_survive_a_gateway_kill(
    net: Net, http: httpx.AsyncClient
) -> None:
    """Issue #25: what a session was given lives in its row, not in the gateway's memory.
    Both sessions' owners default to the wide 'test' policy, which a restarted gateway
    that forgot would hand out."""
    probe = (
        "import requests\n"
        "print(requests.get('https://api.good.test/kept', timeout=30).text)\n"
        "try:\n    requests.get('https://secret.good.test/', timeout=30)\n"
        "except requests.RequestException as exc:\n    print('refused:', exc)\n"
    )
    asked = "import requests\nprint(requests.get('https://ask.good.test/{}', timeout=90).text)\n"
    async with httpx.AsyncClient(
        base_url=net.gateway.url,
        timeout=120 * UNIT,
        headers={"Authorization": f"Bearer {net.bot}"},
    ) as bot:
        tight = await new_session(bot)  # the bot's tier, 'tight', fixes the 'strict' policy
        try:
            mine = await new_session(http)
            r = await http.post(
                f"/v1/sessions/{mine}/executions", json={"code": asked.format("before")}
            )
            eid = r.json()["id"]
            await until_awaiting_input(http, eid)
            await http.post(f"/v1/executions/{eid}/input", json={"value": "session"})
            assert "/before" in text_of(await until_finished(http, eid))
            net.gateway.kill9()
            net.gateway.start()
            assert (await bot.get(f"/v1/sessions/{tight}")).json()["state"] == "ready"
            out = await run(bot, tight, probe)
            assert "hello from api.good.test /kept" in out, out
            assert "not on policy 'strict'" in out, out
            # The human's "for this session" answer holds too: no second question.
            r = await http.post(
                f"/v1/sessions/{mine}/executions", json={"code": asked.format("after")}
            )
            eid = r.json()["id"]
            deadline = asyncio.get_running_loop().time() + 60 * UNIT
            while (info := (await http.get(f"/v1/executions/{eid}")).json())["record"] is None:
                assert info["status"] != "awaiting_input", "asked again after the restart"
                assert asyncio.get_running_loop().time() < deadline, "never finished"
                await asyncio.sleep(0.05)
            assert "hello from ask.good.test /after" in text_of(info), text_of(info)
        finally:
            await bot.delete(f"/v1/sessions/{tight}")


async def test_a_hibernated_tier_session_woken_after_a_restart_keeps_its_runtime(
    tmp_path: Any,
) -> None:
    """Issue #25: the wake-up sandbox of a restarted gateway gets the tier's runtime, not
    the backend's default (for gVisor that would be a downgrade to runc). This daemon has
    no runsc, so the backend's default is another runtime than the tier's ``runc``."""
    instance = f"{RUN_INSTANCE}-tiers"  # its own: its start-up reaps nothing of the module's
    gw = Gateway(
        tmp_path / "data",
        gateway_run_dir(),
        KERNELHUB_DOCKER__IMAGE=IMAGE,
        KERNELHUB_DOCKER__RUNTIME="io.containerd.runc.v2",
        KERNELHUB_GATEWAY__INSTANCE=instance,
        KERNELHUB_GATEWAY__HIBERNATE_AFTER=str(2 * UNIT),
        KERNELHUB_PROFILES__TIERS=json.dumps({"plain": {"isolation": "docker"}}),
    )
    gw.start()
    client = docker.from_env()

    def runtime_of(sid: str) -> str:
        (c,) = client.containers.list(filters={"label": f"org.kernelhub.session={sid}"})
        return str(c.attrs["HostConfig"]["Runtime"])

    try:
        token = gw.token("alice")
        async with httpx.AsyncClient(
            base_url=gw.url, timeout=120 * UNIT, headers={"Authorization": f"Bearer {token}"}
        ) as http:
            sid = await new_session(http, profile="plain")
            assert runtime_of(sid) == "runc"
            await run(http, sid, "x = 41")
            deadline = asyncio.get_running_loop().time() + 60 * UNIT
            while (await http.get(f"/v1/sessions/{sid}")).json()["state"] != "hibernated":
                assert asyncio.get_running_loop().time() < deadline, "never hibernated"
                await asyncio.sleep(0.1)
            gw.kill9()
            gw.start()
            assert "42" in await run(http, sid, "print(x + 1)")
            assert runtime_of(sid) == "runc"
    finally:
        client.close()
        gw.stop()
        remove_sandboxes(instance)
