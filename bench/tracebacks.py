"""What formatting a traceback costs: a pandas KeyError, stock IPython against the kernel.

- The floor, stock IPython on the host: a fresh ``InteractiveShell`` per mode (its own
  process, so the first traceback is as cold as a new kernel's), timing ``run_cell`` of the
  failing cell, first and warm. ``Context`` is IPython's default; ``Plain`` and
  ``Minimal`` are what a user can choose with ``%xmode``.
- kernelhub: a real sandbox of the kernel image (``--image``, default the configured
  one), timing the failing cell end to end against the same cell without the error
  (``df['a']``), first and warm: the difference is what the traceback costs.

Run: ``PYTHONPATH=. .venv/bin/python bench/tracebacks.py [--image kernelhub/kernel:TAG]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import uuid

SETUP = "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2, 3]})"
FAILING = "def pick(frame):\n    return frame['missing']\nx = 1\npick(df)"
SUCCEEDING = "def pick(frame):\n    return frame['a']\nx = 1\npick(df)"
WARM_RUNS = 5

_STOCK = """
import json, sys, time
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell({setup!r})
shell.run_line_magic("xmode", {mode!r})
times = []
for _ in range({runs}):
    t0 = time.perf_counter()
    shell.run_cell({failing!r}, silent=True)
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""


def stock(mode: str) -> list[float]:
    """Seconds per failing cell in a fresh stock IPython, first one first."""
    code = _STOCK.format(setup=SETUP, mode=mode, runs=WARM_RUNS + 1, failing=FAILING)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return list(json.loads(out.strip().splitlines()[-1]))


async def sandboxed(image: str) -> tuple[list[float], list[float], str]:
    """Seconds per failing and per succeeding cell in a fresh sandbox, and the traceback."""
    from kernelhub.config import load_settings
    from kernelhub.execution.engine import KernelSession
    from kernelhub.sandbox.backends import make_backend
    from kernelhub.sandbox.base import SandboxSpec

    settings = load_settings()
    settings = settings.model_copy(
        update={"backend": "docker", "docker": settings.docker.model_copy(update={"image": image})}
    )
    backend = make_backend(settings, instance=f"bench-tb-{uuid.uuid4().hex[:6]}")
    session = await KernelSession.start(backend, SandboxSpec(session_id=uuid.uuid4().hex[:12]))
    failing: list[float] = []
    succeeding: list[float] = []
    text = ""
    try:
        await session.execute(SETUP)
        for _ in range(WARM_RUNS + 1):
            for code, into in ((FAILING, failing), (SUCCEEDING, succeeding)):
                t0 = time.perf_counter()
                execution = await session.execute(code)
                into.append(time.perf_counter() - t0)
                if execution.error is not None:
                    text = execution.error.traceback_text
    finally:
        await session.close()
        await backend.close()
    return failing, succeeding, text


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=None, help="kernel image (default: the configured)")
    parser.add_argument("--no-sandbox", action="store_true", help="only the stock floor")
    args = parser.parse_args()
    print("stock IPython on the host (the floor), pandas KeyError, run_cell:")
    for mode in ("Context", "Plain", "Minimal"):
        times = stock(mode)
        warm = statistics.median(times[1:])
        print(f"  {mode:8} first {_ms(times[0]):>10}   warm median {_ms(warm):>9}")
    if args.no_sandbox:
        return
    from kernelhub.config import load_settings

    image = args.image or load_settings().docker.image
    failing, succeeding, text = asyncio.run(sandboxed(image))
    print(f"kernelhub sandbox ({image}), whole cell, failing vs the same cell succeeding:")
    first = failing[0] - succeeding[0]
    warm = statistics.median(f - s for f, s in zip(failing[1:], succeeding[1:], strict=True))
    print(
        f"  failing  first {_ms(failing[0]):>10}   warm median {_ms(statistics.median(failing[1:])):>9}"
    )
    print(
        f"  ok       first {_ms(succeeding[0]):>10}   warm median {_ms(statistics.median(succeeding[1:])):>9}"
    )
    print(f"  traceback cost: first {_ms(first)}, warm median {_ms(warm)}")
    print("the traceback as the SDK gives it (CellError.traceback_text):")
    print("\n".join(f"    {line}" for line in text.splitlines()))


if __name__ == "__main__":
    main()
