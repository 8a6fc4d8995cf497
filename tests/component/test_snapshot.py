"""Snapshots (``kernel-image/kernelhub_kernel/snapshot/``) between real kernels.

Kernel A runs cells and captures; the snapshot directory is copied (what the host does
with the files: move them as an opaque blob) and restored in a fresh kernel B, whose
workspace is another, empty directory. Values are then checked in B.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import pickle
import shutil
import tarfile
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.component.snapshot_corpus import SESSIONS, Session
from tests.component.test_inkernel import (
    KERNEL_IMAGE,
    RunningKernel,
    StartKernel,
    start_kernel,  # noqa: F401  (the fixture, shared with test_inkernel)
)

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = "__import__('kernelhub_kernel.snapshot', fromlist=['capture'])"


# --- helpers ----------------------------------------------------------------------------


async def run(kernel: RunningKernel, code: str) -> str:
    """Run a cell that must succeed; returns its stdout."""
    cell = await kernel.execute(code)
    assert cell.reply["status"] == "ok", f"{code!r} failed: {cell.reply} {cell.text('stderr')}"
    return cell.text()


async def snapshot_call(kernel: RunningKernel, call: str) -> dict[str, Any]:
    """Call capture/restore the way the host does: a silent execute, the result read
    from user_expressions as application/json."""
    cell = await kernel.execute(
        f"{SNAPSHOT}.{call}",
        silent=True,
        user_expressions={"snapshot": f"{SNAPSHOT}.last_result()"},
    )
    assert cell.reply["status"] == "ok", cell.reply
    result: dict[str, Any] = cell.reply["user_expressions"]["snapshot"]["data"]["application/json"]
    return result


async def check(kernel: RunningKernel, expressions: dict[str, str]) -> dict[str, str]:
    """Evaluate ``bool(expression)`` for each; returns 'True', 'False' or the error."""
    cell = await kernel.execute(
        "", silent=True, user_expressions={k: f"bool({e})" for k, e in expressions.items()}
    )
    out = {}
    for key, value in cell.reply["user_expressions"].items():
        if value["status"] == "ok":
            out[key] = value["data"]["text/plain"]
        else:
            out[key] = f"{value['ename']}: {value['evalue']}"
    return out


async def assert_true(kernel: RunningKernel, expressions: dict[str, str]) -> None:
    results = await check(kernel, expressions)
    bad = {k: (expressions[k], v) for k, v in results.items() if v != "True"}
    assert not bad, bad


async def in_workspace(kernel: RunningKernel) -> None:
    """Sandbox kernels start in their workspace; test kernels start wherever pytest runs."""
    cell = await kernel.execute(
        "__import__('os').chdir(__import__('os').environ['KERNELHUB_WORKSPACE'])", silent=True
    )
    assert cell.reply["status"] == "ok"


class Pair:
    """Kernel A (where cells run) and a fresh kernel B (where the snapshot lands)."""

    def __init__(self, start: StartKernel, tmp_path: Path) -> None:
        self._start = start
        self.tmp = tmp_path
        self.ws_a = tmp_path / "ws-a"
        self.ws_b = tmp_path / "ws-b"
        self.ws_a.mkdir()
        self.ws_b.mkdir()
        self.a: RunningKernel
        self.b: RunningKernel
        self._n = 0

    async def start_a(self) -> RunningKernel:
        self.a = await self._start(KERNELHUB_WORKSPACE=str(self.ws_a))
        await in_workspace(self.a)
        return self.a

    async def start_b(self) -> RunningKernel:
        self.b = await self._start(KERNELHUB_WORKSPACE=str(self.ws_b))
        await in_workspace(self.b)
        return self.b

    def snap_dir(self, kernel: RunningKernel) -> Path:
        self._n += 1
        return kernel.temp_dir / ".kernelhub" / f"snap-{self._n}"

    def move_to_b(self, snap: Path) -> Path:
        """What the host does: take the files out, put them into B's sandbox."""
        target = self.b.temp_dir / ".kernelhub" / snap.name
        shutil.copytree(snap, target)
        return target

    async def capture(self, base: Path | None = None) -> tuple[Path, dict[str, Any]]:
        snap = self.snap_dir(self.a)
        arg = f"{str(snap)!r}" + (f", base={str(base)!r}" if base else "")
        return snap, await snapshot_call(self.a, f"capture({arg})")

    async def restore(self, snap: Path) -> dict[str, Any]:
        return await snapshot_call(self.b, f"restore({str(self.move_to_b(snap))!r})")

    async def roundtrip(self, cells: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        await self.start_a()
        for code in cells:
            await run(self.a, code)
        snap, captured = await self.capture()
        await self.start_b()
        restored = await self.restore(snap)
        return captured, restored


@pytest.fixture
def pair(start_kernel: StartKernel, tmp_path: Path) -> Pair:  # noqa: F811
    return Pair(start_kernel, tmp_path)


# --- values and identity ----------------------------------------------------------------


async def test_values_and_identity_survive(pair: Pair) -> None:
    captured, restored = await pair.roundtrip(
        [
            "import numpy as np, pandas as pd, enum, dataclasses, functools\n"
            "import matplotlib.pyplot as plt",
            "a32 = np.arange(12, dtype=np.float32).reshape(3, 4)\n"
            "fortran = np.asfortranarray(np.arange(6).reshape(2, 3))\n"
            "objects = np.array([1, 'two', None], dtype=object)\n"
            "df = pd.DataFrame({'n': [1, 2, 3], 's': ['a', 'b', None],\n"
            "                   'c': pd.Categorical(['x', 'y', 'x']),\n"
            "                   't': pd.to_datetime(['2024-01-01', '2024-01-02', None]),\n"
            "                   'i': pd.array([1, None, 3], dtype='Int64')},\n"
            "                  index=pd.Index(['r1', 'r2', 'r3'], name='row'))\n"
            "mi = df.set_index(['c', 'n'])",
            "K = 3\n"
            "def add_k(x):\n"
            "    return x + K\n"
            "square = lambda x: x * x\n"
            "def make_acc():\n"
            "    total = [0]\n"
            "    def acc(v):\n"
            "        total[0] += v\n"
            "        return total[0]\n"
            "    return acc\n"
            "acc = make_acc(); acc(5)\n"
            "class Base:\n"
            "    kind = 'base'\n"
            "    def hello(self):\n"
            "        return 'hello from ' + self.kind\n"
            "class Child(Base):\n"
            "    kind = 'child'\n"
            "    def hello(self):\n"
            "        return super().hello() + '!'\n"
            "child = Child()\n"
            "@dataclasses.dataclass(frozen=True)\n"
            "class Run:\n"
            "    name: str\n"
            "    score: float\n"
            "runs = [Run('a', 0.5), Run('b', 0.9)]\n"
            "best = runs[1]\n"
            "class Color(enum.Enum):\n"
            "    RED = 1\n"
            "    GREEN = 2\n"
            "    CRIMSON = 1\n"
            "    def describe(self):\n"
            "        return self.name.lower()\n"
            "class Mode(str, enum.Enum):\n"
            "    FAST = 'fast'\n"
            "favorite = Color.GREEN\n"
            "@functools.lru_cache(maxsize=8)\n"
            "def slow(n):\n"
            "    return n * 2",
            "words = pd.Series([f'w{i}-é-😀' for i in range(5000)] + [None, 'x\\udcff'], dtype=object)\n"
            "labels = pd.Series([f'label {i}' for i in range(3000)] + [None], dtype='str')\n"
            "grid2d = np.asfortranarray(np.array([[f'{i},{j}' for j in range(40)] for i in range(50)], dtype=object))\n"
            "class Tag:\n"
            "    pass\n"
            "tagged = {'tag': Tag(), 'names': [f'n{i}' for i in range(10_000)]}\n"
            "fig, ax = plt.subplots()\n"
            "line, = ax.plot([1, 2, 3])\n"
            "plt.close(fig)\n"
            "tables = {'a': [1, 2], 'b': {'nested': [3]}}\n"
            "t = tables['a']\n"
            "same = t\n"
            "handlers = {'sq': square}\n"
            "del square",
        ]
    )
    assert restored["failed"] == {}, restored["failed"]
    assert captured["skipped"] == {}
    b = pair.b
    await assert_true(
        b,
        {
            "a32": "a32.dtype == np.float32 and a32.shape == (3, 4) and a32[2, 3] == 11",
            "fortran": "fortran.flags.f_contiguous and fortran.tolist() == [[0, 1, 2], [3, 4, 5]]",
            "writable": "a32.flags.writeable",
            "objects": "objects.dtype == object and objects[1] == 'two' and objects[2] is None",
            "df dtypes": "[str(t) for t in df.dtypes] == ['int64', 'str', 'category', 'datetime64[us]', 'Int64']",
            "df index": "df.index.name == 'row' and list(df.index) == ['r1', 'r2', 'r3']",
            "df na": "df['s'].isna().tolist() == [False, False, True] and df['i'].isna().sum() == 1",
            "multiindex": "mi.index.names == ['c', 'n']",
            "function": "add_k(1) == 4",
            "function sees the namespace": "(globals().__setitem__('K', 10), add_k(1))[1] == 11",
            "lambda by value": "handlers['sq'](7) == 49 and 'square' not in globals()",
            "closure keeps its state": "acc(1) == 6",
            "subclass": "isinstance(child, Child) and isinstance(child, Base) and child.hello() == 'hello from child!'",
            "frozen dataclass": "isinstance(best, Run) and best in runs and best is runs[1]",
            "frozen": "Run.__dataclass_params__.frozen",
            "enum": "favorite is Color.GREEN and Color(1) is Color.RED and Color.CRIMSON is Color.RED",
            "enum methods": "favorite.describe() == 'green' and Mode.FAST == 'fast' and Mode('fast') is Mode.FAST",
            "lru_cache": "slow(4) == 8 and slow.cache_info().maxsize == 8",
            "figure identity": "ax.figure is fig and line.axes is ax and line in ax.lines",
            "aliases": "t is tables['a'] and same is t",
            "string column": "words.iloc[4999] == 'w4999-é-😀' and words.iloc[5000] is None and words.iloc[5001] == 'x\\udcff' and len(words) == 5002",
            "str dtype": "str(labels.dtype) == 'str' and labels.iloc[2999] == 'label 2999' and labels.isna().tolist()[-1]",
            "2-d object array": "grid2d.flags.f_contiguous and grid2d[49, 39] == '49,39' and grid2d.shape == (50, 40)",
            "big list in a dill group": "isinstance(tagged['tag'], Tag) and tagged['names'][9999] == 'n9999'",
        },
    )
    groups = {tuple(g["names"]): g for g in captured["groups"]}
    assert ("fig", "ax", "line") in groups, list(groups)
    assert ("Run", "runs", "best") in groups
    assert groups[("a32",)]["pickler"] == "pickle"  # data never goes through dill
    assert groups[("Run", "runs", "best")]["pickler"] == "dill"


async def test_imports_and_execution_count_continue(pair: Pair) -> None:
    await pair.start_a()
    for code in [
        "import numpy as np",
        "import os.path",
        "from os.path import join as pjoin",
        "from collections import OrderedDict",
        "from os import environ",
        "from math import pi",
        "x = 1",
    ]:
        await run(pair.a, code)
    snap, captured = await pair.capture()
    assert captured["imports"] == {
        "np": {"module": "numpy"},
        "os": {"module": "os"},
        "pjoin": {"module": "posixpath", "attr": "join"},
        "OrderedDict": {"module": "collections", "attr": "OrderedDict"},
        "environ": {"module": "os", "attr": "environ"},
        "pi": {"module": "math", "attr": "pi"},
    }
    next_in_a = (await pair.a.execute("1")).reply["execution_count"]
    await pair.start_b()
    restored = await pair.restore(snap)
    assert restored["failed"] == {}
    first_in_b = (await pair.b.execute("1")).reply["execution_count"]
    assert first_in_b == next_in_a == captured["execution_count"]
    await assert_true(
        pair.b,
        {
            "np": "np.__name__ == 'numpy'",
            "os": "os.path.join('a', 'b') == 'a/b'",
            "pjoin": "pjoin is os.path.join",
            "OrderedDict": "OrderedDict is __import__('collections').OrderedDict",
            "environ": "environ is os.environ",
        },
    )


# --- dill's traps, one by one -------------------------------------------------------------


async def test_awkward_objects_are_carried_or_named(pair: Pair) -> None:
    captured, restored = await pair.roundtrip(
        [
            "import logging, threading, socket, sqlite3, hashlib, re, sys, time\n"
            "import concurrent.futures as cf",
            "log = logging.getLogger('trap')\n"
            "log.setLevel(logging.DEBUG)\n"
            "log.propagate = False\n"
            "log.addHandler(logging.StreamHandler(sys.stdout))\n"
            "with open('data.txt', 'w') as w:\n"
            "    w.write('one\\ntwo\\nthree\\n')\n"
            "fh = open('data.txt')\n"
            "fh.readline()\n"
            "out = open('out.bin', 'wb')\n"
            "out.write(b'12345')\n"
            "held = threading.RLock()\n"
            "held.acquire(); held.acquire()\n"
            "free = threading.RLock()\n"
            "locked = threading.Lock(); locked.acquire()",
            "other = threading.RLock()\n"
            "started = threading.Event()\n"
            "def hold():\n"
            "    other.acquire()\n"
            "    started.set()\n"
            "    time.sleep(3600)\n"
            "holder = threading.Thread(target=hold, daemon=True)\n"
            "holder.start(); started.wait()\n"
            "gen = (i for i in range(3))\n"
            "sock = socket.socket()\n"
            "db = sqlite3.connect(':memory:')\n"
            "pool = cf.ThreadPoolExecutor(1)\n"
            "found = re.search('b', 'abc')\n"
            "h = hashlib.sha256(b'x')\n"
            "frame = sys._getframe()\n"
            "shell = get_ipython()\n"
            "deep = {'ok': [1, 2], 'bad': [sock]}\n"
            "key = get_ipython().kernel.session.key",
        ]
    )
    skipped = captured["skipped"]
    expected = {
        "other": "RLock held by another thread",
        "holder": "thread",
        "gen": "generator",
        "sock": "socket",
        "db": "database connection",
        "pool": "executor",
        "found": "match object",
        "h": "hash object",
        "frame": "frame",
        "shell": "kernel internals",
        "deep": "socket",
        "key": "session key",
    }
    assert set(skipped) == set(expected), skipped
    for name, reason in expected.items():
        assert name in skipped and reason in skipped[name], (name, skipped.get(name))
    assert restored["failed"] == {}
    assert restored["skipped"] == skipped
    await assert_true(
        pair.b,
        {
            "logger": "log is logging.getLogger('trap') and log.level == logging.DEBUG and not log.propagate",
            "handler": "len(log.handlers) == 1 and log.handlers[0].stream is sys.stdout",
            "text file position": "fh.tell() == 4 and fh.readline() == 'two\\n' and fh.mode == 'r'",
            "binary file not truncated": "out.mode == 'wb' and (out.write(b'6') or out.flush() or open('out.bin', 'rb').read() == b'123456')",
            "RLock held by this thread": "held._is_owned() and (held.release() or held.release() or True) and not held._is_owned()",
            "RLock free": "not free._is_owned() and free.acquire(blocking=False)",
            "Lock locked": "locked.locked()",
            "closed file": "w.closed and w.name == 'data.txt'",
            "no silent loss": "all(n not in globals() for n in ['gen', 'sock', 'db', 'pool', 'found', 'h', 'frame', 'shell', 'deep', 'key', 'other', 'holder'])",
        },
    )
    # The logger's handler writes to B's stdout.
    cell = await pair.b.execute("log.info('after restore')")
    assert cell.text() == "after restore\n"


async def test_main_references_are_never_written(pair: Pair) -> None:
    """The stdlib pickler 'succeeds' on objects that name ``__main__`` globals, and the
    snapshot would only fail in the new kernel: such pickles are refused at capture."""
    captured, restored = await pair.roundtrip(
        [
            "class Singleton:\n"
            "    def __reduce__(self):\n"
            "        return 'THE_ONE'\n"
            "THE_ONE = Singleton()\n"
            "holder = [THE_ONE]\n"
            "def f():\n"
            "    return 42\n"
            "refs = {'f': f}\n"
            "del f",
        ]
    )
    assert "__main__.THE_ONE" in captured["skipped"].get("holder", ""), captured["skipped"]
    await assert_true(pair.b, {"by value": "refs['f']() == 42 and 'f' not in globals()"})
    assert restored["failed"] == {}


# --- failure isolation and the trust boundary ---------------------------------------------


def _rewrite_group(snap: Path, name: str, data: bytes, fix_manifest: bool) -> None:
    manifest = json.loads((snap / "manifest.json").read_text())
    (entry,) = [g for g in manifest["groups"] if name in g["names"]]
    path = snap / entry["file"]
    path.unlink()  # hard-linked files must not be written through
    path.write_bytes(data)
    if fix_manifest:
        entry.update(
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
            pickle_bytes=len(data),
            buffers=[],
            pickler="pickle",
        )
        (snap / "manifest.json").write_text(json.dumps(manifest))


class _RunsCode:
    """Unpickling this runs a shell command: what a hostile snapshot looks like."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


async def test_one_bad_group_does_not_take_the_others_down(pair: Pair) -> None:
    await pair.start_a()
    await run(pair.a, "a = [1, 2]\nb = {'x': 1}\nc = 'keep me'\nbig = bytes(9 << 20)")
    snap, captured = await pair.capture()
    local = pair.tmp / "corrupt"
    shutil.copytree(snap, local)
    _rewrite_group(local, "a", b"not a pickle", fix_manifest=False)  # corrupted in transit
    _rewrite_group(local, "b", pickle.dumps(ValueError), fix_manifest=True)
    # Same size, one byte flipped: it unpickles, then its sha256 (checked meanwhile, in a
    # thread, for a large file) does not match, and the name is taken back.
    (big_file,) = [g["file"] for g in captured["groups"] if g["names"] == ["big"]]
    with open(local / big_file, "r+b") as f:
        f.seek(5 << 20)
        f.write(b"\x01")
    await pair.start_b()
    restored = await snapshot_call(pair.b, f"restore({str(pair.move_to_b(local))!r})")
    assert "bytes" in restored["failed"]["a"]
    assert "sha256" in restored["failed"]["big"]
    assert restored["restored"] == ["b", "c"]  # b loads, as ValueError: no loss of c
    await assert_true(
        pair.b,
        {"c": "c == 'keep me'", "a": "'a' not in globals()", "big": "'big' not in globals()"},
    )


async def test_hostile_snapshot_only_ever_loads_in_the_sandbox(pair: Pair) -> None:
    """Snapshots are made by untrusted code. Moving the files (the host's part) runs
    nothing; loading them runs their code, which is why only the in-sandbox module ever
    loads them, with the sandbox's own rights."""
    await pair.start_a()
    await run(pair.a, "data = [1, 2, 3]")
    snap, _ = await pair.capture()
    marker = Path("/tmp") / f"pwned-{uuid.uuid4().hex}"
    hostile = pickle.dumps(_RunsCode(str(marker)), protocol=5)
    local = pair.tmp / "hostile"
    shutil.copytree(snap, local)
    _rewrite_group(local, "data", hostile, fix_manifest=True)
    await pair.start_b()
    try:
        moved = pair.move_to_b(local)  # the host's whole job: bytes in, bytes out
        assert not marker.exists()
        restored = await snapshot_call(pair.b, f"restore({str(moved)!r})")
        # Loaded inside kernel B: it ran there, as B's user code could anyway.
        assert marker.exists()
        assert restored["restored"] == ["data"]
    finally:
        marker.unlink(missing_ok=True)
    # Nothing on the host side deserializes snapshot data: the only loaders in the
    # repository are in the in-sandbox module.
    loaders = []
    for path in [*REPO.joinpath("kernelhub").rglob("*.py"), *KERNEL_IMAGE.rglob("*.py")]:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in {"load", "loads", "Unpickler"}:
                root = node.value
                if isinstance(root, ast.Name) and root.id in {"pickle", "dill", "cloudpickle"}:
                    loaders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert all(loc.startswith("kernel-image/kernelhub_kernel/snapshot/") for loc in loaders), (
        loaders
    )
    assert loaders, "the in-sandbox loader was not found: the scan is broken"


async def test_workspace_files_come_back_and_bad_paths_do_not(pair: Pair) -> None:
    await pair.start_a()
    (pair.ws_a / "sub").mkdir()
    (pair.ws_a / "sub" / "data.csv").write_text("a,b\n1,2\n")
    (pair.ws_a / "empty").mkdir()
    (pair.ws_a / "link").symlink_to("sub/data.csv")
    (pair.ws_a / "abs-link").symlink_to(pair.ws_a / "sub" / "data.csv")
    os.mkfifo(pair.ws_a / "fifo")
    snap, captured = await pair.capture()
    assert captured["workspace"]["files"] == 1
    assert [s["path"] for s in captured["workspace"]["skipped"]] == ["fifo"]

    # A tampered tar: traversal, absolute paths, links out of the workspace.
    local = pair.tmp / "tampered"
    shutil.copytree(snap, local)
    outside = pair.tmp / f"outside-{uuid.uuid4().hex}"
    with tarfile.open(local / "workspace.tar", "a") as tar:
        for name in ["../" + outside.name, str(outside)]:
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
        link = tarfile.TarInfo("escape")
        link.type = tarfile.SYMTYPE
        link.linkname = "../../../../etc/passwd"
        tar.addfile(link)
    manifest = json.loads((local / "manifest.json").read_text())
    manifest["workspace"]["sha256"] = hashlib.sha256(
        (local / "workspace.tar").read_bytes()
    ).hexdigest()
    (local / "manifest.json").write_text(json.dumps(manifest))

    await pair.start_b()
    restored = await snapshot_call(pair.b, f"restore({str(pair.move_to_b(local))!r})")
    assert (pair.ws_b / "sub" / "data.csv").read_text() == "a,b\n1,2\n"
    assert (pair.ws_b / "empty").is_dir()
    assert os.readlink(pair.ws_b / "link") == "sub/data.csv"
    assert os.readlink(pair.ws_b / "abs-link") == "sub/data.csv"  # made relative
    refused = {r["path"] for r in restored["workspace"]["refused"]}
    assert refused == {"../" + outside.name, str(outside), "escape"}, refused
    assert not outside.exists()
    assert not (pair.ws_b / "escape").exists()


# --- incremental capture --------------------------------------------------------------------


async def test_incremental_capture_rewrites_only_what_changed(pair: Pair) -> None:
    await pair.start_a()
    await run(
        pair.a,
        "import numpy as np\n"
        "big = np.random.default_rng(0).random(4_000_000)\n"  # 32 MB
        "counter = 0\n"
        "notes = []",
    )
    snap1, full = await pair.capture()
    big_file = next(g["file"] for g in full["groups"] if g["names"] == ["big"])

    async def step(code: str, base: Path) -> tuple[Path, dict[str, Any]]:
        await run(pair.a, code)
        snap, result = await pair.capture(base)
        assert result["incremental"], result["full_reason"]
        return snap, result

    # A small change: the big group is hard-linked, not written.
    snap2, inc = await step("counter += 1\nnotes.append('x')", snap1)
    assert (snap2 / big_file).stat().st_ino == (snap1 / big_file).stat().st_ino
    assert inc["written_bytes"] < 100_000 < full["written_bytes"]
    # Reading the array does not rewrite it.
    snap3, inc = await step(
        "total = big.sum()\nmean = float(np.mean(big))\nprint(big.shape)", snap2
    )
    assert inc["written_bytes"] < 100_000
    # Mutating it does.
    snap4, inc = await step("big[0] = -1.0", snap3)
    assert inc["written_bytes"] > 30_000_000
    # Something the tracker cannot follow: everything is pickled again.
    snap5, inc = await step("exec('counter = 100')", snap4)
    assert any("cannot follow" in w for w in inc["warnings"])

    await pair.start_b()
    restored = await pair.restore(snap5)
    assert restored["failed"] == {}
    await assert_true(
        pair.b,
        {
            "counter": "counter == 100",
            "notes": "notes == ['x']",
            "big": "big[0] == -1.0 and big.shape == (4_000_000,)",
            "total": "abs(total - mean * 4_000_000) < 1e-3",
        },
    )
    # B can continue incrementally from the restored snapshot.
    await run(pair.b, "counter += 1")
    base = pair.b.temp_dir / ".kernelhub" / snap5.name
    nxt = await snapshot_call(pair.b, f"capture({str(base) + '-next'!r}, base={str(base)!r})")
    assert nxt["incremental"] and nxt["written_bytes"] < 100_000


async def test_snapshot_files_are_what_the_result_lists(pair: Pair) -> None:
    await pair.start_a()
    await run(pair.a, "import numpy as np\nx = np.ones(10)\ndef f(): return x")
    snap, captured = await pair.capture()
    on_disk = sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())
    assert on_disk == sorted(captured["files"])
    assert captured["size_bytes"] == sum((snap / f).stat().st_size for f in on_disk)
    for group in captured["groups"]:
        data = (snap / group["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == group["sha256"]
        assert group["file"] == f"groups/{group['sha256'][:32]}.pkl"
    # Capturing into a directory that is not empty is kernelhub's failure, not data.
    cell = await pair.a.execute(f"{SNAPSHOT}.capture({str(snap)!r})", silent=True)
    assert cell.reply["status"] == "error" and cell.reply["ename"] == "FileExistsError"


# --- the corpus -----------------------------------------------------------------------------


@pytest.mark.timeout(900)
async def test_corpus_of_agent_sessions(start_kernel: StartKernel, tmp_path: Path) -> None:  # noqa: F811
    """Every session of ``snapshot_corpus``: the share of variables restored correctly
    must be at least 99%, and every variable not restored must be named with a reason."""
    lines = []
    total = correct = 0
    silent_losses: list[str] = []
    for session in SESSIONS:
        (tmp_path / session.name).mkdir()
        pair = Pair(start_kernel, tmp_path / session.name)
        n, ok, losses = await _run_session(pair, session)
        total += n
        correct += ok
        silent_losses += losses
        lines.append(f"  {session.name:22} {ok:3}/{n:<3} restored correctly")
    percent = 100.0 * correct / total
    print("\nsnapshot corpus:\n" + "\n".join(lines))
    print(f"  {'all':22} {correct:3}/{total:<3} = {percent:.1f}% of variables restored correctly")
    assert not silent_losses, silent_losses
    assert percent >= 99.0


async def _run_session(pair: Pair, session: Session) -> tuple[int, int, list[str]]:
    captured, restored = await pair.roundtrip(session.cells)
    names = set(captured["saved"]) | set(captured["skipped"]) | set(captured["imports"])
    expected = set(session.checks) | set(session.skipped)
    uncovered = names - expected - set(captured["imports"])
    assert not uncovered, f"{session.name}: variables without a check: {sorted(uncovered)}"
    assert expected <= names, f"{session.name}: not in kernel A: {sorted(expected - names)}"
    losses = []
    for name, reason in session.skipped.items():
        got = captured["skipped"].get(name, "")
        if reason not in got:
            losses.append(f"{session.name}.{name}: expected skipped for {reason!r}, got {got!r}")
    results = await check(pair.b, session.checks)
    imports = await check(
        pair.b,
        {
            name: (
                f"getattr(__import__({spec['module']!r}, fromlist=['x']), {spec['attr']!r}) is {name}"
                if "attr" in spec
                else f"{name}.__name__ == {spec['module']!r}"
            )
            for name, spec in captured["imports"].items()
        },
    )
    results.update(imports)
    named = set(captured["skipped"]) | set(restored["failed"])
    ok = 0
    for name, outcome in results.items():
        if outcome == "True":
            ok += 1
        elif name not in named:
            losses.append(f"{session.name}.{name}: {session.checks.get(name)!r} -> {outcome}")
        else:
            print(
                f"{session.name}.{name}: named loss: {captured['skipped'].get(name) or restored['failed'].get(name)}"
            )
    return len(results), ok, losses


# --- the cell analysis, as data -------------------------------------------------------------


def _load_snapshot_module() -> types.ModuleType:
    from tests.unit.snapshot.kernel_side import load

    return load()


@pytest.mark.parametrize(
    ("source", "mutated", "unknown"),
    [
        ("x = 1", {"x"}, False),
        ("x += 1", {"x"}, False),
        ("a[0] = 1\nb.c.d = 2\ndel e['k']", {"a", "b", "e"}, False),
        ("lst.append(1)", {"lst"}, False),
        ("s = df.groupby('k').mean()", {"s"}, False),
        ("df.drop(columns=['a'], inplace=True)", {"df"}, False),
        ("df.loc[df.x > 0, 'y'] = 0", {"df"}, False),
        ("print(df.shape, len(df))\ndisplay(df.head())", set(), False),
        ("np.random.shuffle(arr)", {"arr"}, False),
        ("m = np.mean(arr)", {"m"}, False),
        ("train(model, data)", {"model", "data"}, False),
        ("for row in rows: pass", {"row"}, False),
        ("import numpy as np\nfrom os import path as p", {"np", "p"}, False),
        ("def f():\n    global g\n    g = 1", {"f", "g"}, False),
        ("exec('x = 1')", set(), True),
        ("globals()['x'] = 1", set(), True),
        ("%time y = f(x)", {"y", "x"}, False),
        ("%matplotlib inline", set(), False),
        ("%run script.py", set(), True),
        ("!ls", set(), False),
        ("z = !ls", {"z"}, False),
        ("%%time\nw = 1", {"w"}, False),
        ("%%writefile f.py\nprint(1)", set(), False),
        ("%%bash\necho hi", set(), False),
        ("%%something_unknown\nq = 1", set(), True),
    ],
)
def test_cell_analysis(source: str, mutated: set[str], unknown: bool) -> None:
    snapshot = _load_snapshot_module()
    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    ns = {"df": _FakeFrame(), "arr": _FakeArray(), "np": types.ModuleType("numpy")}
    usage = snapshot.analyze_cell(source, ns, transform)
    assert usage.mutated == mutated
    assert usage.unknown is unknown


_FakeFrame = type("DataFrame", (), {"__module__": "pandas.core.frame"})
_FakeArray = type("ndarray", (), {"__module__": "numpy"})


def test_globals_used_by_cell_functions_count_as_mutated() -> None:
    snapshot = _load_snapshot_module()
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(
        "state = []\n"
        "def inner():\n    state.append(1)\n"
        "def outer():\n    inner()\n"
        "class Box:\n    def put(self):\n        registry.append(self)\n"
        "box = Box()\n",
        ns,
    )
    usage = snapshot.analyze_cell("outer()\nbox.put()", ns)
    found = snapshot._globals_used_by(usage.called, ns)
    assert {"inner", "state", "registry"} <= found
