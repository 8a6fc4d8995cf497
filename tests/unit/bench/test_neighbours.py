"""The neighbours benchmark's pure parts: per-callback CPU (bench/loop_cpu.py) and the
docs section its --out rewrites."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import loop_cpu
from neighbours import BEGIN, END, write_section


def test_a_callback_that_burns_cpu_is_logged_with_its_cpu_and_name(tmp_path: Path) -> None:
    def burn() -> None:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass

    async def main() -> None:
        asyncio.get_running_loop().call_soon(burn)
        await asyncio.sleep(0.01)

    stop = loop_cpu.install(tmp_path)
    try:
        asyncio.run(main())
    finally:
        stop()
    found = loop_cpu.read(tmp_path, os.getpid())
    burnt = [c for c in found if "burn" in c.what]
    assert burnt and 0.019 <= burnt[0].cpu <= burnt[0].wall + 0.001


def test_out_rewrites_only_its_section(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nprose before\n\n{BEGIN}\nold table\n{END}\n\nprose after\n")
    write_section(page, f"{BEGIN}\nnew table\n{END}")
    assert page.read_text() == (
        f"# Title\n\nprose before\n\n{BEGIN}\nnew table\n{END}\n\nprose after\n"
    )
    fresh = tmp_path / "fresh.md"
    write_section(fresh, f"{BEGIN}\nt\n{END}")
    assert BEGIN in fresh.read_text() and fresh.read_text().startswith("# ")
