"""What only the docker backend promises: the posture from inside and outside, resource
limits in force, containment of memory and fork bombs, labels and orphan reaping."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import docker
import pytest

from kernelhub.config import EngineSettings, Limits, Settings
from kernelhub.errors import UnsafeSocketError
from kernelhub.execution.engine import KernelSession
from kernelhub.models import ExecutionStatus
from kernelhub.sandbox.base import SandboxSpec
from kernelhub.sandbox.docker import DockerBackend, DockerSandbox
from tests.conftest import RUN_INSTANCE, UNIT

pytestmark = pytest.mark.docker
MiB = 2**20
PROBES = Path(__file__).parent / "probes"


@pytest.fixture
async def backend(settings: Settings) -> AsyncIterator[DockerBackend]:
    b = DockerBackend(image=settings.docker.image, run_dir=settings.run_dir, instance=RUN_INSTANCE)
    yield b
    await b.close()


@pytest.fixture
async def sessions(backend: DockerBackend) -> AsyncIterator[list[KernelSession]]:
    made: list[KernelSession] = []
    yield made
    for s in made:
        await s.close()


async def start(
    backend: DockerBackend, made: list[KernelSession], **limits: object
) -> KernelSession:
    spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], owner="tests", limits=Limits(**limits))
    s = await KernelSession.start(backend, spec, engine=EngineSettings(start_timeout=60 * UNIT))
    made.append(s)
    return s


POSTURE = r"""
import json, os, socket, threading
def status(path):
    out = {}
    for line in open(path):
        k, _, v = line.partition(':')
        out[k] = v.strip()
    return out
main = status('/proc/self/status')
seen = {}
def worker():
    seen.update(status('/proc/thread-self/status'))
t = threading.Thread(target=worker); t.start(); t.join()
try:
    open('/usr/kernelhub-write-test', 'w')
    root_ro = False
except OSError as e:
    root_ro = e.errno == 30
ws = os.statvfs('/workspace')
print(json.dumps({
    'uid': os.getuid(), 'gid': os.getgid(),
    'cap_eff': main['CapEff'], 'cap_bnd': main['CapBnd'], 'cap_prm': main['CapPrm'],
    'no_new_privs': main['NoNewPrivs'], 'seccomp': main['Seccomp'],
    'thread_seccomp': seen['Seccomp'],
    'root_read_only': root_ro,
    'interfaces': sorted(name for _, name in socket.if_nameindex()),
    'workspace_bytes': ws.f_blocks * ws.f_frsize,
    'mounts': [l.split()[1:4] for l in open('/proc/self/mounts') if l.split()[1] in ('/workspace', '/tmp')],
    'cwd': os.getcwd(), 'pid1': open('/proc/1/cmdline').read().replace('\0', ' '),
}))
"""


async def test_posture_from_inside(backend: DockerBackend, sessions: list[KernelSession]) -> None:
    s = await start(backend, sessions, workspace_bytes=16 * MiB)
    result = await s.execute(POSTURE)
    assert result.status == ExecutionStatus.COMPLETED, result.error
    p = json.loads(result.stdout)
    assert p["uid"] != 0 and p["gid"] != 0
    assert int(p["cap_eff"], 16) == 0 and int(p["cap_prm"], 16) == 0 and int(p["cap_bnd"], 16) == 0
    assert p["no_new_privs"] == "1"
    assert p["seccomp"] == "2" and p["thread_seccomp"] == "2"
    assert p["root_read_only"]
    assert p["interfaces"] == ["lo"]
    assert p["workspace_bytes"] == 16 * MiB
    for target, fstype, opts in p["mounts"]:
        assert fstype == "tmpfs" and "nosuid" in opts and "nodev" in opts, (target, opts)
    assert p["cwd"] == "/workspace"
    assert "kernelhub_kernel.supervisor" in p["pid1"]


async def test_posture_from_outside(backend: DockerBackend, sessions: list[KernelSession]) -> None:
    s = await start(backend, sessions, memory_bytes=256 * MiB, cpus=0.5, pids=100)
    assert isinstance(s.sandbox, DockerSandbox)
    client = docker.from_env()
    attrs = client.api.inspect_container(s.sandbox.id)
    client.close()
    hc = attrs["HostConfig"]
    assert hc["NetworkMode"] == "none" and hc["ReadonlyRootfs"] is True
    assert hc["CapDrop"] == ["ALL"] and not hc["CapAdd"] and not hc["Privileged"]
    assert hc["Memory"] == hc["MemorySwap"] == 256 * MiB
    assert hc["NanoCpus"] == 500_000_000 and hc["PidsLimit"] == 100
    assert "no-new-privileges:true" in hc["SecurityOpt"]
    assert any(o.startswith("seccomp=") for o in hc["SecurityOpt"])
    assert hc["LogConfig"]["Config"].get("max-size")
    assert not attrs["NetworkSettings"]["Ports"]
    key = s.sandbox.session_dir.key.get_secret_value()
    assert key not in json.dumps(attrs["Config"]["Env"])
    # The limits are in force in the kernel's cgroup, not just in the config.
    inside = await s.execute(
        "import os\n"
        "cg = [l.split(':')[2] for l in open('/proc/self/cgroup').read().splitlines() if ':memory:' in l or l.startswith('0::')][0]\n"
        "print(cg)"
    )
    assert inside.status == ExecutionStatus.COMPLETED
    usage = s.sandbox.usage()
    assert usage.memory_bytes is not None and 0 < usage.memory_bytes < 256 * MiB


async def test_memory_bomb_dies_alone(
    backend: DockerBackend, sessions: list[KernelSession]
) -> None:
    bomb = await start(backend, sessions, memory_bytes=256 * MiB)
    bystander = await start(backend, sessions)
    result = await bomb.execute(
        "blocks = []\nwhile True:\n    blocks.append(bytearray(32 * 2**20))", timeout=60 * UNIT
    )
    assert result.status == ExecutionStatus.KERNEL_DIED
    assert result.record.reason == "out of memory: limit 256 MiB"
    assert (await bystander.execute("1 + 1")).text == "2"


async def test_fork_bomb_is_contained_by_the_pids_limit(
    backend: DockerBackend, sessions: list[KernelSession]
) -> None:
    s = await start(backend, sessions, pids=64)
    result = await s.execute(
        "import os, time\n"
        "children = []\n"
        "try:\n"
        "    while True:\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        children.append(pid)\n"
        "except OSError as e:\n"
        "    print('stopped at', len(children), e.errno)\n"
        "for pid in children:\n"
        "    os.kill(pid, 9)\n"
        "    os.waitpid(pid, 0)\n",
        timeout=60 * UNIT,
    )
    assert result.status == ExecutionStatus.COMPLETED, result.error
    stopped = int(result.stdout.split()[2])
    assert stopped < 64
    assert (await s.execute("1 + 1")).text == "2"


async def test_host_files_are_invisible(
    backend: DockerBackend, sessions: list[KernelSession], tmp_path: Path
) -> None:
    secret = tmp_path / f"host-secret-{uuid.uuid4().hex}"
    secret.write_text("host only")
    s = await start(backend, sessions)
    here = str(Path(__file__).resolve())
    result = await s.execute(
        "import os\n"
        f"print(os.path.exists({str(secret)!r}), os.path.exists({here!r}), os.path.exists('/var/run/docker.sock'))\n"
        "print(sorted(os.listdir('/run/kernelhub')))"
    )
    assert result.stdout.splitlines()[0] == "False False False"
    assert result.stdout.splitlines()[1] == "['ipc', 'kernel.json']"


async def test_symlink_planted_in_socket_dir_is_refused(
    backend: DockerBackend, sessions: list[KernelSession]
) -> None:
    s = await start(backend, sessions)
    result = await s.execute(
        "import os\n"
        "os.unlink('/run/kernelhub/ipc/k-1')\n"
        "os.symlink('/var/run/docker.sock', '/run/kernelhub/ipc/k-1')\n"
        "print(os.readlink('/run/kernelhub/ipc/k-1'))"
    )
    assert result.stdout.strip() == "/var/run/docker.sock"
    with pytest.raises(UnsafeSocketError, match="symlink"):
        s.sandbox.session_dir.open_sockets()


async def test_seccomp_refuses_what_docker_default_allows(
    backend: DockerBackend, sessions: list[KernelSession]
) -> None:
    s = await start(backend, sessions)
    code = (PROBES / "syscalls.py").read_text()
    result = await s.execute(code, timeout=60 * UNIT)
    assert result.status == ExecutionStatus.COMPLETED, result.error
    probes = json.loads(result.stdout.strip().splitlines()[-1])
    modes = probes.pop("seccomp_mode_all_threads")
    assert set(modes.values()) == {2} or modes.get("main") == 2, modes
    not_refused = {name: p for name, p in probes.items() if not p["refused"]}
    assert not not_refused, not_refused


async def test_orphans_are_found_by_label_and_reaped(settings: Settings) -> None:
    instance = f"{RUN_INSTANCE}o"
    crashed = DockerBackend(
        image=settings.docker.image, run_dir=settings.run_dir, instance=instance
    )
    spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], owner="tests")
    session = await KernelSession.start(crashed, spec)
    cid = session.sandbox.id
    root = session.sandbox.session_dir.root
    # The process "crashes": nothing is closed. A new kernelhub with the same instance starts.
    await crashed.close()
    fresh = DockerBackend(image=settings.docker.image, run_dir=settings.run_dir, instance=instance)
    try:
        assert await fresh.reap_orphans() == 1
    finally:
        await fresh.close()
    client = docker.from_env()
    assert not client.containers.list(all=True, filters={"id": cid})
    client.close()
    assert not root.exists()
    # Release the abandoned session's host-side sockets (its sandbox is already gone).
    await session.detach()


async def test_a_kernel_busy_in_a_cell_is_reattached_at_once(backend: DockerBackend) -> None:
    """Re-adoption after a gateway restart must not wait for the running cell to end."""
    import asyncio
    import time

    spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], owner="tests")
    first = await KernelSession.start(backend, spec, engine=EngineSettings(start_timeout=60 * UNIT))
    again = None
    try:
        await first.execute("x = 7")
        await first.submit("import time; time.sleep(60)")
        await asyncio.sleep(0.5)
        await first.detach()
        t0 = time.monotonic()
        again = await KernelSession.attach(
            first.sandbox, engine=EngineSettings(start_timeout=20 * UNIT)
        )
        assert time.monotonic() - t0 < 5 * UNIT
        assert again.alive
        await again.sandbox.interrupt()  # end the orphaned cell; the kernel keeps x
        result = await again.execute("print(x)", timeout=30 * UNIT)
        assert result.status == ExecutionStatus.COMPLETED and result.stdout == "7\n"
    finally:
        await (again or first).close()


async def test_a_library_error_costs_a_plain_traceback_not_seconds(
    backend: DockerBackend, sessions: list[KernelSession]
) -> None:
    """The kernel formats tracebacks in Plain mode (stock IPython's Context mode took
    1.3-2.6 s for this KeyError): the user's frames, one line each, no context blocks."""
    s = await start(backend, sessions)
    await s.execute("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2]})")
    ok = await s.execute("def pick(frame):\n    return frame['a']\nx = 1\npick(df)")
    failed = await s.execute("def pick(frame):\n    return frame['missing']\nx = 1\npick(df)")
    assert failed.error is not None and failed.error.name == "KeyError"
    text = failed.error.traceback_text
    assert "Cell In[3], line 4" in text and "return frame['missing']" in text
    assert "---->" not in text and "\x1b" not in text  # no Context-mode source blocks
    assert failed.record.duration - ok.record.duration < 0.3 * UNIT, (failed.record, ok.record)


async def test_a_kernel_starts_without_the_debugger_and_its_cgroup_is_read(
    backend: DockerBackend, sessions: list[KernelSession]
) -> None:
    s = await start(backend, sessions)
    # The cgroup inspect ran beside the kernel's start: accounting is there before a cell.
    assert s.usage().cpu_seconds is not None
    assert "debugger" not in s.kernel_info.get("supported_features", [])
    assert not s.kernel_info.get("debugger", False)
    result = await s.execute(
        "import sys\n"
        "print('pydevd' in ' '.join(sys.modules), sys.modules.get('debugpy', 0) is None)\n"
        "import debugpy\n"  # lifted after the kernel's start: user code may still import it
        "print(debugpy.__name__)"
    )
    assert result.status == ExecutionStatus.COMPLETED, result.error
    assert result.stdout.split() == ["False", "False", "debugpy"]
