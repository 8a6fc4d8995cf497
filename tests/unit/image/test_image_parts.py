"""The host-side parts of image building that need no Docker (kernelhub/image/process.py,
build.py's profile lock and final check, base.py's scratch cleanup): a real subprocess,
real files in a temporary directory, this machine's real mount table."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernelhub.errors import ImageBuildError
from kernelhub.image.base import _mounts_under, _remove_scratch
from kernelhub.image.build import _settle_build, profile_lock
from kernelhub.image.process import TAIL_LINES, format_tail, run_streaming

PY = sys.executable


def test_run_streaming_passes_both_streams_in_order_and_returns_the_status() -> None:
    seen: list[str] = []
    code = (
        "import sys\n"
        "print('out 1', flush=True)\n"
        "print('err 2', file=sys.stderr, flush=True)\n"
        "print('out 3', flush=True)\n"
        "sys.exit(3)"
    )
    status, tail = run_streaming([PY, "-c", code], seen.append)
    assert status == 3 and seen == ["out 1", "err 2", "out 3"] == tail


def test_run_streaming_keeps_only_the_last_lines_and_replaces_bad_bytes() -> None:
    code = f"import sys\nfor i in range({TAIL_LINES + 10}): print(i)\nsys.stdout.buffer.write(b'\\xff!\\n')"
    seen: list[str] = []
    status, tail = run_streaming([PY, "-c", code], seen.append)
    assert status == 0 and len(seen) == TAIL_LINES + 11
    assert tail == [str(i) for i in range(11, TAIL_LINES + 10)] + ["\ufffd!"]


def test_run_streaming_passes_the_environment_given() -> None:
    seen: list[str] = []
    code = "import os; print(os.environ.get('KH_PROBE'), 'HOME' in os.environ)"
    run_streaming([PY, "-c", code], seen.append, env={"KH_PROBE": "yes"})
    assert seen == ["yes False"]


def test_a_program_that_cannot_start_is_an_image_build_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-program")
    with pytest.raises(ImageBuildError, match=f"cannot run {missing}"):
        run_streaming([missing], print)


def test_a_progress_callback_that_raises_kills_the_program(tmp_path: Path) -> None:
    marker = tmp_path / "finished"
    code = f"import time\nprint('go', flush=True)\ntime.sleep(30)\nopen({str(marker)!r}, 'w')"

    def stop(line: str) -> None:
        raise KeyboardInterrupt

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_streaming([PY, "-c", code], stop)
    assert time.monotonic() - started < 20 and not marker.exists()


def test_format_tail() -> None:
    assert format_tail([]) == ""
    assert format_tail(["a", "b"]) == "\n--- output (last lines) ---\na\nb"


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    (tmp_path / "requirements.txt").write_text("# the slim lock\nipykernel==6.29.5\nPyZMQ==26.0\n")
    (tmp_path / "requirements-data-science.txt").write_text("numpy==2.0.0\npyzmq==26.0\n")
    return tmp_path


def test_the_same_pin_twice_is_one_line_and_an_unreadable_extra_names_itself(
    sources: Path,
) -> None:
    # (the other refusals: tests/unit/image/test_build.py)
    assert profile_lock(sources, "data-science") == (
        "ipykernel==6.29.5\nnumpy==2.0.0\npyzmq==26.0\n"  # PyZMQ and pyzmq, pinned alike
    )
    absent = sources / "absent.txt"
    with pytest.raises(ImageBuildError, match=f"cannot read the requirements file {absent}"):
        profile_lock(sources, "slim", absent)


@dataclass
class Built:
    id: str
    size_bytes: int = 3 * 2**20


def test_a_build_whose_tag_moved_meanwhile_is_refused() -> None:
    with pytest.raises(ImageBuildError, match="another build may have run"):
        _settle_build(None, "kh:t", Built("sha256:b"), "sha256:a", None, 0.0, print)  # type: ignore[arg-type]


def test_a_settled_build_says_what_it_made() -> None:
    said: list[str] = []
    info = Built("sha256:" + "a" * 64)
    # the same id as before: nothing was replaced, so Docker is never asked to remove it
    got = _settle_build(None, "kh:t", info, info.id, info.id, time.monotonic(), said.append)  # type: ignore[arg-type]
    assert got is info and len(said) == 1
    assert said[0].startswith(f"built kh:t ({info.id[:19]}, 3.0 MiB) in ")


def test_mounts_under_reads_the_real_mount_table(tmp_path: Path) -> None:
    assert _mounts_under(tmp_path) == []
    proc = _mounts_under(Path("/proc"))
    assert proc[-1] == "/proc"  # deepest first, the path itself last
    assert all(p == "/proc" or p.startswith("/proc/") for p in proc)
    assert _mounts_under(Path("/pro")) == []  # a prefix of a name is not "under"


def test_remove_scratch_removes_a_tree_without_mounts(tmp_path: Path) -> None:
    scratch = tmp_path / "kernelhub-rootfs-x"
    (scratch / "rootfs" / "etc").mkdir(parents=True)
    (scratch / "rootfs" / "etc" / "hostname").write_text("x")
    said: list[str] = []
    _remove_scratch(scratch, said.append)
    assert not scratch.exists() and said[-1].startswith("removed the temporary root file system")
