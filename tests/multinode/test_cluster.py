"""Many machines, one API (issue #24), on a real loopback cluster (conftest.py): sessions
created through two replicas spread over three node agents; a stream on one replica of a
session made through the other, resumed there gap-free; a replica killed mid-stream loses
nothing; node agents refuse clients without the cluster's certificate; a node that cannot
be reached is a typed 503; Jupyter's own client and the MCP SDK work through a replica."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import docker
import httpx
import nbformat
import pytest
import websockets
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from nbclient import NotebookClient

from kernelhub.client import AsyncHub, AsyncSession
from kernelhub.client import errors as client_errors
from kernelhub.cluster.certs import make_certs
from kernelhub.cluster.models import NodeInfo
from kernelhub.jupyter.provisioner import KernelhubKernelManager
from kernelhub.models import Event, StreamEvent
from kernelhub.store.postgres import PostgresStore
from kernelhub.store.records import StoredSession
from tests.conftest import UNIT
from tests.multinode.conftest import Cluster, Replica, tls_context

pytestmark = [pytest.mark.multinode, pytest.mark.docker, pytest.mark.postgres, pytest.mark.s3,
              pytest.mark.timeout(240)]  # fmt: skip

# A cell whose output is its own oracle: consecutive numbers, a little apart.
COUNT = "import time\nfor i in range({n}):\n    print(i, flush=True)\n    time.sleep({gap})"


def hub(replica: Replica, token: str) -> AsyncHub:
    return AsyncHub(replica.url, token, timeout=120 * UNIT)


def instance_of(session_id: str) -> str:
    """The instance label of the container running ``session_id``: which node runs it."""
    client = docker.from_env()
    try:
        (c,) = client.containers.list(filters={"label": f"org.kernelhub.session={session_id}"})
        return str(c.labels["org.kernelhub.instance"])
    finally:
        client.close()


async def events_until(
    session: AsyncSession, since: int, stop: int | None = None, *, final_of: str | None = None
) -> list[Event]:
    """The session's events after ``since``: ``stop`` of them, or up to ``final_of``'s
    final event; the stream is closed (the client disconnects) after. (Seqs are strictly
    increasing, not consecutive: an execution's queued state takes numbers it does not
    keep, so the oracle is the whole transcript read again.)"""
    got: list[Event] = []
    async with contextlib.aclosing(session.events(since)) as stream:
        async for event in stream:
            got.append(event)
            if stop is not None and len(got) >= stop:
                break
            if final_of is not None and event.execution_id == final_of and event.type == "final":
                break
    return got


def printed(events: list[Event]) -> list[int]:
    text = "".join(e.text for e in events if isinstance(e, StreamEvent) and e.name == "stdout")
    return [int(line) for line in text.split()]


async def test_sessions_created_through_both_replicas_spread_over_the_nodes(
    cluster: Cluster,
) -> None:
    alice = cluster.alice  # type: ignore[attr-defined]
    a, b = cluster.replicas
    async with hub(a, alice) as ha, hub(b, alice) as hb:
        made = await asyncio.gather(*(h.create_session() for h in (ha, hb, ha, hb, ha, hb)))
        try:
            ran = await asyncio.gather(*(s.run("6 * 7") for s in made))
            assert all(r.results and r.results[-1].text == "42" for r in ran)
            where = [instance_of(s.id) for s in made]
            store = await PostgresStore.open(cluster.store_url)
            try:
                rows = [await store.get_session(s.id) for s in made]
            finally:
                await store.close()
            by_node = {n.instance: n.id for n in cluster.nodes}
            # The store's row and the container agree on the node.
            assert [by_node[w] for w in where] == [r.node for r in rows if r is not None]
            counts = {n.id: [by_node[w] for w in where].count(n.id) for n in cluster.nodes}
            assert all(c >= 1 for c in counts.values()) and max(counts.values()) <= 3, counts
        finally:
            await asyncio.gather(*(s.delete() for s in made))


async def test_a_restarted_node_agent_takes_back_its_own_sessions_only(cluster: Cluster) -> None:
    """All nodes share one store: a node that restarts re-adopts the sessions whose row
    names it, and leaves the others' alone (reporting them dead would end them)."""
    alice = cluster.alice  # type: ignore[attr-defined]
    async with hub(cluster.replicas[0], alice) as h:
        made = [await h.create_session() for _ in range(3)]
        try:
            for i, s in enumerate(made):
                await s.run(f"mark = {i}")
            on = {instance_of(s.id) for s in made}
            restarted = next(n for n in cluster.nodes if n.instance in on)
            restarted.stop()
            restarted.start()
            restarted.wait_ready(f"{restarted.address}/readyz", verify=cluster.gateway_tls())
            for i, s in enumerate(made):
                assert (await s.run("print(mark)")).stdout == f"{i}\n"
                assert (await s.info()).state == "ready"
            # What every other node and replica reads: the store's rows, none reported dead.
            store = await PostgresStore.open(cluster.store_url)
            try:
                rows = [await store.get_session(s.id) for s in made]
            finally:
                await store.close()
            assert [(r.state, r.reason) for r in rows if r] == [("ready", None)] * 3
        finally:
            await drop(*made)


async def drop(*sessions: AsyncSession) -> None:
    """Delete the session once and release every SDK object of it (a hub's HTTP pool
    closes when the last session object it gave out is deleted)."""
    for session in sessions:
        with contextlib.suppress(client_errors.NotFoundError, client_errors.SessionEndedError):
            await session.delete()


async def test_a_stream_on_one_replica_resumes_on_the_other_gap_free(cluster: Cluster) -> None:
    alice = cluster.alice  # type: ignore[attr-defined]
    a, b = cluster.replicas
    async with hub(b, alice) as hb, hub(a, alice) as ha:
        made = await hb.create_session()
        on_a = on_b = made
        try:
            on_a = await ha.session(made.id)
            first = await on_a.run("x = 21")
            streamed: list[str] = []
            counted = await on_a.run(COUNT.format(n=40, gap=0.005), on_stdout=streamed.append)
            assert [int(v) for v in "".join(streamed).split()] == list(range(40))
            head = await events_until(on_a, 0, stop=7)  # then the client disconnects
            on_b = await hb.session(made.id)
            tail = await events_until(on_b, head[-1].seq, final_of=counted.id)
            # Gap-free: exactly the session's whole transcript, read again in one go.
            whole = await events_until(on_b, 0, final_of=counted.id)
            assert [e.seq for e in head + tail] == [e.seq for e in whole]
            assert printed(head + tail) == list(range(40))
            assert {e.execution_id for e in head + tail} == {first.id, counted.id}
            doubled = await on_b.run("x * 2")
            assert doubled.results[-1].text == "42"
            # Bodies stream both ways through the replicas: up through one, down the other.
            data = os.urandom(3 * 2**20)
            await on_a.upload("blob.bin", data)
            assert await on_b.download("blob.bin") == data
        finally:
            await drop(made, on_a, on_b)


async def test_killing_a_replica_mid_stream_loses_nothing(cluster: Cluster) -> None:
    alice = cluster.alice  # type: ignore[attr-defined]
    doomed = Replica(cluster, "gc").start_ready()
    survivor = cluster.replicas[0]
    try:
        async with hub(doomed, alice) as hd, hub(survivor, alice) as hs:
            made = await hd.create_session()
            on_s = made
            try:
                await made.run("kept = 'state'")
                running = await made.submit(COUNT.format(n=30, gap=0.1))
                head = await events_until(made, 0, stop=6)
                assert printed(head), head  # output has been flowing through the doomed one
                doomed.kill9()
                on_s = await hs.session(made.id)
                tail = await events_until(on_s, head[-1].seq, final_of=running.id)
                whole = await events_until(on_s, 0, final_of=running.id)
                assert [e.seq for e in head + tail] == [e.seq for e in whole]
                assert printed(head + tail) == list(range(30))
                assert tail[-1].type == "final"
                assert (await on_s.run("print(kept)")).stdout == "state\n"
            finally:
                await drop(on_s)
                doomed.start_ready()  # back on its port: its client's session object is released
                await drop(made)
    finally:
        doomed.stop()


async def test_node_agents_accept_only_the_clusters_certificates(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    ok = await asyncio.to_thread(
        httpx.get, f"{node.address}/healthz", verify=cluster.gateway_tls(), timeout=10
    )
    assert ok.status_code == 200
    # Another CA's gateway certificate, and no certificate at all: no HTTP answer, ever.
    other = cluster.root / "other-ca"
    make_certs(other, [], ["intruder"])
    foreign = tls_context(other, "gateway-intruder")
    foreign.load_verify_locations(str(cluster.certs / "ca.pem"))  # it trusts the node
    bare = ssl.create_default_context(cafile=str(cluster.certs / "ca.pem"))
    for ctx in (foreign, bare):
        with pytest.raises(httpx.TransportError):
            await asyncio.to_thread(httpx.get, f"{node.address}/healthz", verify=ctx, timeout=10)
    with pytest.raises(httpx.TransportError):  # nor in plain HTTP
        await asyncio.to_thread(httpx.get, f"http://{node.host}:{node.port}/healthz", timeout=10)


async def test_a_session_on_an_unreachable_node_is_a_typed_503(cluster: Cluster) -> None:
    alice = cluster.alice  # type: ignore[attr-defined]
    now = datetime.now(UTC)
    store = await PostgresStore.open(cluster.store_url)
    try:
        # A node whose row is fresh but whose agent listens nowhere (it just died).
        await store.upsert_node(
            NodeInfo(
                id="ghost",
                address="https://127.0.0.9:9",
                started_at=now,
                heartbeat_at=now,
                lease_expires_at=now + timedelta(hours=1),
            )
        )
        await store.insert_session(
            StoredSession(
                id="feedfacecafe0001",
                owner="alice",
                backend="docker",
                state="ready",
                created_at=now,
                limits={},
                metadata={},
                reason=None,
                deleted_at=None,
                node="ghost",
            )
        )
    finally:
        await store.close()
    r = await asyncio.to_thread(
        httpx.get,
        f"{cluster.replicas[1].url}/v1/sessions/feedfacecafe0001",
        headers={"Authorization": f"Bearer {alice}"},
        timeout=30,
    )
    store = await PostgresStore.open(cluster.store_url)
    try:
        await store.delete_node("ghost")  # the emergency stop below would reach for it
    finally:
        await store.close()
    assert r.status_code == 503, r.text
    assert r.json()["error"] == "node_unavailable" and "'ghost'" in r.json()["message"]


async def ws_outcome(url: str, token: str, tls: ssl.SSLContext | None) -> tuple[str, int]:
    """How a stream handshake ends: refused with an HTTP status, or closed with a code."""
    try:
        async with websockets.connect(
            url, additional_headers={"Authorization": f"Bearer {token}"}, ssl=tls, proxy=None
        ) as ws:
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 30 * UNIT)
            return "closed", int(ws.close_code or 0)
    except websockets.InvalidStatus as exc:
        return "refused", exc.response.status_code


async def test_a_relayed_stream_ends_as_the_nodes_own_does(cluster: Cluster) -> None:
    """Refusals and close codes reach the client through a replica exactly as the node
    gives them (an unknown session, a bad token)."""
    alice = cluster.alice  # type: ignore[attr-defined]
    node, replica = cluster.nodes[0], cluster.replicas[0]
    path = "/v1/sessions/0000000000000000/stream"
    for token in (alice, "kh_not_a_token"):
        direct = await ws_outcome(
            node.address.replace("https", "wss") + path, token, cluster.gateway_tls()
        )
        relayed = await ws_outcome(replica.url.replace("http", "ws") + path, token, None)
        assert relayed == direct, (token, direct, relayed)
        assert direct[1] in (404, 4404, 401, 4401), direct


async def test_an_unknown_token_is_refused_by_the_replica(cluster: Cluster) -> None:
    r = await asyncio.to_thread(
        httpx.get,
        f"{cluster.replicas[0].url}/v1/sessions",
        headers={"Authorization": "Bearer kh_not_a_token"},
        timeout=30,
    )
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"


async def test_nbclient_runs_a_notebook_through_a_replica(cluster: Cluster) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("y = 6"), nbformat.v4.new_code_cell("y * 7")]
    km = KernelhubKernelManager(gateway_url=cluster.replicas[1].url, token=cluster.alice)  # type: ignore[attr-defined]
    client = NotebookClient(nb, km=km, timeout=int(120 * UNIT), startup_timeout=int(120 * UNIT))
    await client.async_execute(cleanup_kc=True)
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == "42"


def test_the_e2b_sdk_through_one_replica_then_the_other(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    e2b_ci = pytest.importorskip("e2b_code_interpreter")

    def point_at(replica: Replica) -> None:
        monkeypatch.setenv("E2B_API_URL", f"{replica.url}/e2b")
        monkeypatch.setenv("E2B_SANDBOX_URL", f"{replica.url}/e2b")
        monkeypatch.setenv("E2B_API_KEY", cluster.alice)  # type: ignore[attr-defined]
        monkeypatch.delenv("E2B_DEBUG", raising=False)

    a, b = cluster.replicas
    point_at(a)
    sbx = e2b_ci.Sandbox.create()
    try:
        sbx.run_code("x = 1")
        sbx.files.write("notes/n.txt", "hi")
        point_at(b)
        again = e2b_ci.Sandbox.connect(sbx.sandbox_id)
        assert again.run_code("x += 1; x").text == "2"
        assert again.files.read("notes/n.txt") == "hi"
    finally:
        sbx.kill()


@contextlib.asynccontextmanager
async def mcp_through(replica: Replica, token: str) -> AsyncIterator[Client]:
    env = {**os.environ, "KERNELHUB_URL": replica.url, "KERNELHUB_TOKEN": token}
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "kernelhub.agents.mcp_server"], env=env
    )
    with open(os.devnull, "w") as errlog:
        async with Client(stdio_client(params, errlog=errlog)) as client:
            yield client


async def test_the_mcp_sdk_through_a_replica_keeps_state(cluster: Cluster) -> None:
    def text(result: object) -> str:
        return "".join(getattr(c, "text", "") for c in getattr(result, "content", []))

    async with mcp_through(cluster.replicas[0], cluster.alice) as client:  # type: ignore[attr-defined]
        first = text(await client.call_tool("execute_python", {"code": "z = 5"}))
        handle = first.rsplit("[session handle: ", 1)[1].rstrip("]")
        kept = await client.call_tool("execute_python", {"code": "print(z * 2)", "session": handle})
        assert text(kept).startswith("[stdout]\n10\n"), text(kept)


async def test_the_emergency_stop_through_a_replica_stops_every_node(cluster: Cluster) -> None:
    """Last in the module: it ends every session of the cluster."""
    root = cluster.token("root", admin=True)
    async with hub(cluster.replicas[1], cluster.alice) as h:  # type: ignore[attr-defined]
        made = [await h.create_session() for _ in range(3)]
        assert len({instance_of(s.id) for s in made}) >= 2  # on several nodes
        r = await asyncio.to_thread(
            httpx.post,
            f"{cluster.replicas[0].url}/v1/admin/stop-all",
            headers={"Authorization": f"Bearer {root}"},
            timeout=120 * UNIT,
        )
        assert r.status_code == 200, r.text
        assert r.json()["stopped"] >= 3 and r.json()["nodes"] == 3
        for s in made:
            with pytest.raises(client_errors.SessionEndedError):
                await s.run("1")
        await drop(*made)
    refused = await asyncio.to_thread(
        httpx.post,
        f"{cluster.replicas[0].url}/v1/admin/stop-all",
        headers={"Authorization": f"Bearer {cluster.alice}"},  # type: ignore[attr-defined]
        timeout=30,
    )
    assert refused.status_code == 403 and refused.json()["error"] == "forbidden"
