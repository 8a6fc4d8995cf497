"""CPU per `1+1` cell, process by process: the gateway's hot path measured without the
machine's load in the number (issue #20).

Wall-clock latency on a shared 2-core machine mostly measures the neighbours; CPU time
does not. Each contender runs blocks of cells, the contenders taking turns (A B C, then
C B A, ...), and each process's CPU time (user + system, all its threads) over a block is
divided by the block's cells:

- ``kernelhub``: N sessions over the WebSocket (``bench/gateway.py``'s client): the
  gateway process (and its main thread apart), the kernels' containers (their cgroups),
  and this process (the clients);
- ``before`` (with ``--baseline DIR``): the same on a second gateway running the
  ``kernelhub`` package found in DIR (``git archive <commit> kernelhub | tar -x -C DIR``),
  and/or (``--before-image TAG``) another kernel image: before and after a change in one run;
- ``floor``: N stock ipykernels on the host, each driven by jupyter_client
  (``bench/floor.py``): the kernels and this process (the clients).

``core share`` is a process's CPU over the block's wall time: whether the gateway
saturates its core at N sessions. On a machine whose cores are all busy, throughput
follows the CPU all processes spend per cell, whichever process spends it.

    PYTHONPATH=$PWD python bench/hotpath.py --cells 200 --blocks 5
    PYTHONPATH=$PWD python bench/hotpath.py --sessions 50 --cells 10 --blocks 4
    PYTHONPATH=$PWD python bench/hotpath.py --profile gw.txt      # py-spy of the gateway
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import docker
import gateway
import psutil
from floor import BareContainers, FloorKernel, await_reply
from gateway import Gateway, WsSession
from harness import SMALL_SESSION, STREAMS, gather_limited
from jupyter_client.asynchronous.client import AsyncKernelClient

from kernelhub.config import Settings
from kernelhub.sandbox.base import LABEL_INSTANCE, LABEL_MANAGED, LABEL_SESSION

Cell = Callable[[], Awaitable[float]]


def cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def main_thread_cpu(pid: int) -> float:
    """CPU seconds of a process's main thread (the gateway's event loop)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cgroup_cpu(container_id: str) -> float:
    """Seconds of CPU of one container (cgroup v1 cpuacct, or v2 cpu.stat)."""
    for path in (
        f"/sys/fs/cgroup/cpuacct/docker/{container_id}/cpuacct.usage",
        f"/sys/fs/cgroup/cpu,cpuacct/docker/{container_id}/cpuacct.usage",
    ):
        with contextlib.suppress(OSError):
            return int(Path(path).read_text()) / 1e9
    for path in (
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cpu.stat",
        f"/sys/fs/cgroup/docker/{container_id}/cpu.stat",
    ):
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                if line.startswith("usage_usec"):
                    return int(line.split()[1]) / 1e6
    raise RuntimeError(f"no cgroup CPU counter found for container {container_id}")


class Contender:
    """Cells to run, and the CPU counters (seconds) read around each block."""

    def __init__(self, cells: list[Cell], meters: dict[str, Callable[[], float]]) -> None:
        self.cells = cells
        self.meters = {**meters, "client": time.process_time}

    def read(self) -> dict[str, float]:
        return {name: read() for name, read in self.meters.items()}


class ContainedFloor:
    """A stock ipykernel in a bare hardened container, driven by jupyter_client over ipc:
    the floor with its kernel scheduled as ours are. (Docker puts every container under
    one cgroup whose CPU weight equals one host process group's; under load, kernels in
    containers share that weight with every other container on the machine, while host
    kernels compete with only their own session.)"""

    def __init__(self, container: Any, sdir: Any, kc: AsyncKernelClient) -> None:
        self.container, self.sdir, self.kc = container, sdir, kc

    @classmethod
    async def start(cls, bare: BareContainers) -> ContainedFloor:
        config, sdir = bare.stock_kernel_config()
        container = await asyncio.to_thread(bare.client.containers.run, **config)
        kc = AsyncKernelClient()
        kc.load_connection_info(sdir.host_connection_info())  # type: ignore[arg-type]
        while not sdir.sockets_present():
            await asyncio.sleep(0.01)
        kc.start_channels()
        await kc.wait_for_ready(timeout=60)
        return cls(container, sdir, kc)

    async def roundtrip(self, code: str = "1+1") -> float:
        t0 = time.perf_counter()
        reply = await await_reply(self.kc, self.kc.execute(code), timeout=30)
        elapsed = time.perf_counter() - t0
        assert reply["status"] == "ok", reply
        return elapsed

    async def stop(self) -> None:
        self.kc.stop_channels()
        await asyncio.to_thread(self.container.remove, force=True)
        self.sdir.remove()


class Ours:
    """A gateway with ``n`` sessions and a WebSocket client each."""

    def __init__(self, gw: Gateway, run: str, stack: contextlib.AsyncExitStack) -> None:
        self.gw, self.run, self.stack = gw, run, stack
        self.kernel_pid = 0  # the first session's sandbox init (py-spy follows its children)

    @classmethod
    async def start(
        cls, root: Path, name: str, n: int, env: dict[str, str], stack: contextlib.AsyncExitStack
    ) -> tuple[Ours, Contender]:
        run = f"hot-{name}-{uuid.uuid4().hex[:6]}"
        (root / name).mkdir()
        gw = await Gateway.launch(root / name, instance=run, env=env)
        stack.push_async_callback(gw.stop)
        dock = docker.from_env()
        stack.callback(dock.close)

        def sweep() -> None:
            # This run's label in the filter: a listing of every managed container inspects
            # each one, and another run's container removed meanwhile raised NotFound.
            label = f"{LABEL_INSTANCE}={run}"
            for c in dock.containers.list(all=True, filters={"label": label}):
                with contextlib.suppress(docker.errors.NotFound):
                    c.remove(force=True)

        stack.push_async_callback(asyncio.to_thread, sweep)
        http = await stack.enter_async_context(gw.client())
        sids = await gather_limited(8, [lambda: gateway.create_session(http, SMALL_SESSION)] * n)
        for sid in sids:
            stack.push_async_callback(gateway.delete_session, http, sid)
        containers = {
            c.labels[LABEL_SESSION]: c.id
            for c in dock.containers.list(filters={"label": f"{LABEL_MANAGED}=true"})
            if c.labels.get(LABEL_INSTANCE) == run
        }
        clients = [await stack.enter_async_context(WsSession(gw, s)) for s in sids]
        assert gw.proc is not None
        proc = psutil.Process(gw.proc.pid)
        ours = cls(gw, run, stack)
        ours.kernel_pid = int(dock.api.inspect_container(containers[sids[0]])["State"]["Pid"])
        return ours, Contender(
            [c.run for c in clients],
            {
                "gateway": lambda: cpu(proc),
                "gateway loop": lambda: main_thread_cpu(proc.pid),
                "kernels": lambda: sum(cgroup_cpu(c) for c in containers.values()),
            },
        )


def spread(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):8.3f} [{xs[0]:.3f}–{xs[-1]:.3f}]"


def py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` (and its children) while holding the GIL: raw collapsed
    stacks for a ``.txt`` file, speedscope otherwise."""
    exe = str(Path(sys.executable).with_name("py-spy"))
    fmt = "raw" if out.suffix == ".txt" else "speedscope"
    return subprocess.Popen(
        [exe, "record", "--format", fmt, "-o", str(out), "--pid", str(pid), "--rate", "500",
         "--nonblocking", "--gil", "--subprocesses"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=200, help="cells per session per block")
    parser.add_argument("--blocks", type=int, default=5, help="blocks of each contender")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--baseline", type=Path, help="a directory holding the old kernelhub")
    parser.add_argument(
        "--before-image", help="the 'before' gateway's kernel image (KERNELHUB_DOCKER__IMAGE)"
    )
    parser.add_argument("--profile", type=Path, help="py-spy file of the gateway")
    parser.add_argument("--profile-kernel", type=Path, help="py-spy file of a kernel")
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument(
        "--contained-floor", action="store_true",
        help="also the floor's stock kernels in bare hardened containers ('floor-c')",
    )  # fmt: skip
    parser.add_argument(
        "--signal", action="store_true",
        help="SIGUSR1 to the gateway before and after each of its blocks (a profiler's switch)",
    )  # fmt: skip
    args = parser.parse_args()

    checkpoints = os.environ.get("KERNELHUB_GATEWAY__CHECKPOINTS", "off")
    env = {
        "KERNELHUB_POOL__SIZE": "0",
        "KERNELHUB_GATEWAY__MAX_SESSIONS": "128",
        "KERNELHUB_GATEWAY__MAX_SESSIONS_PER_PRINCIPAL": "128",
        "KERNELHUB_GATEWAY__CHECKPOINTS": checkpoints,
        **STREAMS,
    }
    root = Path(tempfile.mkdtemp(prefix="kh-hot-", dir="/tmp"))
    n = args.sessions
    contenders: dict[str, Contender] = {}
    floors: list[FloorKernel] = []
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        ours, contenders["kernelhub"] = await Ours.start(root, "kernelhub", n, env, stack)
        if args.baseline or args.before_image:
            before_env = dict(env)
            if args.baseline:
                path = f"{args.baseline.resolve()}:{os.environ.get('PYTHONPATH', '')}"
                before_env["PYTHONPATH"] = path
            if args.before_image:
                before_env["KERNELHUB_DOCKER__IMAGE"] = args.before_image
            _, contenders["before"] = await Ours.start(root, "before", n, before_env, stack)
        if not args.no_floor:
            floors = await gather_limited(8, [lambda: FloorKernel.start(root)] * n)
            stack.push_async_callback(
                asyncio.gather, *(f.stop() for f in floors), return_exceptions=True
            )
            contenders["floor"] = Contender(
                [f.roundtrip for f in floors],
                {"kernels": lambda: sum(cpu(psutil.Process(f.pid)) for f in floors)},
            )
        if args.contained_floor:
            settings = Settings()
            dock = docker.from_env()
            stack.callback(dock.close)
            bare = BareContainers(
                dock, image=settings.docker.image, runtime=settings.docker.runtime,
                run_dir=settings.run_dir, instance=f"hot-floor-{uuid.uuid4().hex[:6]}",
            )  # fmt: skip
            contained = await gather_limited(8, [lambda: ContainedFloor.start(bare)] * n)
            stack.push_async_callback(
                asyncio.gather, *(k.stop() for k in contained), return_exceptions=True
            )
            ids = [k.container.id for k in contained]
            contenders["floor-c"] = Contender(
                [k.roundtrip for k in contained],
                {"kernels": lambda: sum(cgroup_cpu(i) for i in ids)},
            )
        for c in contenders.values():  # warm up, untimed
            for _ in range(5):
                await asyncio.gather(*(cell() for cell in c.cells))
        results: dict[str, dict[str, list[float]]] = {k: {} for k in contenders}
        spy: subprocess.Popen[bytes] | None = None
        for block in range(args.blocks):
            order = list(contenders)
            if block % 2:
                order.reverse()
            for name in order:
                c = contenders[name]
                if name == "kernelhub" and spy is None and (args.profile or args.profile_kernel):
                    assert ours.gw.proc is not None
                    if args.profile:
                        spy = py_spy(ours.gw.proc.pid, args.profile)
                    else:
                        spy = py_spy(ours.kernel_pid, args.profile_kernel)
                    await asyncio.sleep(1)
                latencies: list[float] = []

                async def one(cell: Cell, into: list[float] = latencies) -> None:
                    for _ in range(args.cells):
                        into.append(await cell())

                if args.signal and name == "kernelhub" and ours.gw.proc is not None:
                    ours.gw.proc.send_signal(signal.SIGUSR1)
                before = c.read()
                t0 = time.perf_counter()
                await asyncio.gather(*(one(cell) for cell in c.cells))
                wall = time.perf_counter() - t0
                after = c.read()
                if args.signal and name == "kernelhub" and ours.gw.proc is not None:
                    ours.gw.proc.send_signal(signal.SIGUSR1)
                total = n * args.cells
                r = results[name]
                for key in before:
                    spent = after[key] - before[key]
                    r.setdefault(f"{key} ms/cell", []).append(1e3 * spent / total)
                    r.setdefault(f"{key} core share", []).append(spent / wall)
                r.setdefault("all ms/cell", []).append(
                    1e3 * sum(after[k] - before[k] for k in before if k != "gateway loop") / total
                )
                r.setdefault("cells/s", []).append(total / wall)
                latencies.sort()
                r.setdefault("latency p50 ms", []).append(1e3 * statistics.median(latencies))
                r.setdefault("latency p99 ms", []).append(
                    1e3 * latencies[int(0.99 * (len(latencies) - 1))]
                )
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        print(
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end;"
            f" {n} session(s), {args.cells} cells each a block, {args.blocks} blocks,"
            f" checkpoints {checkpoints}; median [min–max] over blocks"
        )
        for name, r in results.items():
            print(f"== {name}")
            for key, xs in r.items():
                print(f"  {key:24s} {spread(xs)}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
