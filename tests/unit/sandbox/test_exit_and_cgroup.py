from __future__ import annotations

from pathlib import Path

from kernelhub.sandbox.cgroup import CgroupFiles
from kernelhub.sandbox.exit import describe_exit


def test_exit_reasons_in_words() -> None:
    assert describe_exit(137, oom_killed=True, memory_limit=512 * 2**20).reason == (
        "out of memory: limit 512 MiB"
    )
    assert describe_exit(139).reason == "kernel killed by SIGSEGV"
    assert describe_exit(-11).reason == "kernel killed by SIGSEGV"
    assert describe_exit(3).reason == "kernel exited with status 3"
    assert describe_exit(None).reason == "the sandbox stopped"


def test_cgroup_v1_paths(tmp_path: Path) -> None:
    (tmp_path / "cpuacct").mkdir()
    lines = [
        "4:memory:/docker/abc",
        "2:cpuacct:/docker/abc",
        "1:cpu:/docker/abc",
        "0::/",
    ]
    files = CgroupFiles.from_proc_cgroup(lines, tmp_path)
    assert files is not None and not files.v2
    assert files.memory_peak == tmp_path / "memory/docker/abc/memory.max_usage_in_bytes"
    assert files.cpu_usage == tmp_path / "cpuacct/docker/abc/cpuacct.usage"


def test_cgroup_v2_reads_usage(tmp_path: Path) -> None:
    base = tmp_path / "system.slice/docker-abc.scope"
    base.mkdir(parents=True)
    (base / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 1\n")
    (base / "memory.current").write_text("1048576\n")
    (base / "memory.peak").write_text("2097152\n")
    files = CgroupFiles.from_proc_cgroup(["0::/system.slice/docker-abc.scope"], tmp_path)
    assert files is not None and files.v2
    usage = files.read()
    assert usage.cpu_seconds == 2.5
    assert usage.memory_bytes == 2**20 and usage.peak_memory_bytes == 2**21


def test_missing_files_read_as_none(tmp_path: Path) -> None:
    files = CgroupFiles.from_proc_cgroup(["0::/gone"], tmp_path)
    assert files is not None
    usage = files.read()
    assert usage.cpu_seconds is None and usage.memory_bytes is None
