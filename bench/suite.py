"""The benchmark suite: every measurement against an honest floor and its peers, in one run,
into one table and its charts.

    python bench/suite.py [--quick] [--only exec,cold,...] [--sessions 10,50] [--out FILE]
                          [--readme FILE | --no-readme]

Machines here are shared and noisy, so every comparison is taken in interleaved rounds
(``rounds.py``: each contender in turn, the first rotating from round to round, after
untimed warm-up, at least 3 rounds) and reported as the median of the rounds [min–max];
ratios are per round. Sections, in order:

- exec (``latency.py``): ``1+1`` through the engine, REST and the WebSocket, against a stock
  ipykernel driven by jupyter_client and by a raw pyzmq client (the floors), and Jupyter
  Kernel Gateway and Jupyter Server, each as shipped and with TCP_NODELAY (the peers);
- first-output (``latency.py``): ``print`` to its first output against a stock kernel that
  prints with ``flush=True``, and the peers doing the same;
- cold (``starts.py``): a new session vs a bare hardened container running stock ipykernel;
- warm (``starts.py``): bursts of twice the warm pool's size from a full pool, p90;
- concurrency (``load.py``): throughput and p99 with n sessions vs n stock kernels, and
  Jupyter Kernel Gateway with n kernels;
- output (``load.py``): 50 MB of output over the WebSocket vs a stock kernel, gateway RSS;
- memory, hibernate (``idle.py``): an idle session's sandbox vs a bare ipykernel; hibernation;
- wake, checkpoint (``durable.py``): a 100 MiB session waking from hibernation vs a cold
  start (``wake.py``); small cells with checkpoints on vs off (``checkpoints.py``);
- snapshot (``snapshot_section.py``): capture and restore vs their floors.

Every target the issues set is a :class:`targets.Target` on its row, and the "met" column
is computed from the row's own number. Charts (``charts.py``) are drawn from the same run
into the report's directory. A full run into docs/benchmarks.md also rewrites the README's
block between ``<!-- bench:start -->`` and ``<!-- bench:end -->`` with every targeted row
(``--readme`` names another file, ``--no-readme`` leaves it). ``--quick`` runs every
section with few samples (a smoke test; it never touches the README); its numbers are not
for quoting. Everything talks to loopback or unix sockets only. A full run takes about
21 minutes on 2 shared cores at load 8-15 (each section measured at the full plan there:
exec 115 s, first-output 107, cold 87, warm 147, output 66, memory 6, hibernate 19, wake
28, checkpoint 72, snapshot 160; concurrency estimated at ~7 min); the report's "Sections"
table gives each run's own times. ``bench/neighbours.py``
(issue #16) runs alone: its floods would disturb every other section.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import charts
import durable
import idle
import latency
import load
import snapshot_section
import starts
from harness import FULL, QUICK, Plan, Suite
from report import REPO, Row, describe_machine, headline, markdown, rewrite_block

from kernelhub.config import load_settings

SECTIONS: dict[str, Callable[[Suite], Awaitable[list[Row]]]] = {
    "exec": latency.exec_roundtrip,
    "first-output": latency.first_output,
    "cold": starts.cold_start,
    "warm": starts.warm_start,
    "concurrency": load.concurrency,
    "output": load.big_output,
    "memory": idle.idle_memory,
    "hibernate": idle.hibernation,
    "wake": durable.wake_time,
    "checkpoint": durable.checkpoint_cost,
    "snapshot": snapshot_section.snapshots,
}
DEFAULT_OUT = REPO / "docs" / "benchmarks.md"
NEIGHBOURS = (
    "Not in this run: `bench/neighbours.py` (issue #16: a neighbour's `1+1` p99 ≤ 250 ms and"
    " the gateway's RSS growth ≤ 64 MiB while another tenant floods it with output) runs"
    " alone into [tenant-safety.md](tenant-safety.md): its floods take minutes and would"
    " load the machine under every other section."
)


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


async def run(plan: Plan, only: list[str], out: Path, command: str, readme: Path | None) -> int:
    settings = load_settings(backend="docker")
    run_id = f"kb{uuid.uuid4().hex[:6]}"
    root = Path(tempfile.mkdtemp(prefix="khb"))  # short: the floor's ipc socket paths
    suite = Suite(plan, settings, root, run_id)
    failed = 0
    started = time.perf_counter()
    loads: list[tuple[str, str]] = []
    timings: list[tuple[str, float, str]] = []  # section, seconds, load average before it
    try:
        await suite.open()
        machine = describe_machine(
            suite.docker.info(), suite.docker.version(),
            runtime=settings.docker.runtime, image=settings.docker.image,
        )  # fmt: skip
        for name, section in SECTIONS.items():
            if only and name not in only:
                continue
            loads.append((name, load_average()))
            print(f"[{time.perf_counter() - started:6.1f} s] {name} (load {loads[-1][1]}) …",
                  flush=True)  # fmt: skip
            t0 = time.perf_counter()
            try:
                rows = await section(suite)
            except Exception as exc:
                traceback.print_exc()
                failed += 1
                rows = [Row(name, "section failed", f"{type(exc).__name__}: {exc}")]
            timings.append((name, time.perf_counter() - t0, loads[-1][1]))
            for row in rows:
                print(f"    {row.measurement}: {row.value}  {row.floor}  {row.ratio}", flush=True)
            suite.rows += rows
    finally:
        await suite.close()
        shutil.rmtree(root, ignore_errors=True)
    took = time.perf_counter() - started
    machine.append(("load average at the end", load_average()))
    quick = plan == QUICK
    preamble = [
        f"Generated by `{command}` in {took:.0f} s, sections: {', '.join(n for n, _ in loads)}."
        + (" **A quick run: few samples, a smoke test; not numbers to quote.**" if quick else ""),
        "",
        "Every ratio divides by a floor or peer measured in the same run, in interleaved"
        " rounds with a rotating order (the machines are shared and noisy: ratios are what"
        " carries over). A cell reads `median [min–max]`: the median of the rounds' own"
        " medians (or p99s, or rates) and their range; a ratio is the median of the rounds'"
        " own ratios [their range]. The load average is in the machine table and before"
        " each section: above the core count, every number here is a shared machine's."
        " A target is the issue's bound; \"met\" compares the row's median with it (and"
        " says when some round missed it), computed by the suite, not written by hand.",
        "",
        NEIGHBOURS,
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    drawn = charts.draw(suite.series, out.parent)
    text = markdown(
        title="Benchmarks", preamble=preamble, machine=machine, rows=suite.rows,
        notes=suite.notes, charts=[(title, path.name) for title, path in drawn],
        sections=timings,
    )  # fmt: skip
    print()
    print(text)
    out.write_text(text)
    print(f"written to {out}" + "".join(f", {path}" for _, path in drawn))
    if readme is not None and failed and not quick:
        print(f"{readme} not rewritten: {failed} sections failed", file=sys.stderr)
    elif readme is not None and not quick:
        source = (
            f"From `{command}` on {time.strftime('%Y-%m-%d', time.gmtime())}"
            f" ({os.cpu_count()} shared cores, load average {loads[0][1] if loads else '?'}"
            f" at the start; floors, spreads and charts in"
            f" [{out.name}]({os.path.relpath(out.resolve(), readme.resolve().parent)}))."
        )
        try:
            readme.write_text(rewrite_block(readme.read_text(), headline(suite.rows, source)))
        except (OSError, ValueError) as exc:
            print(f"{readme} not rewritten: {exc}", file=sys.stderr)
            return 1
        print(f"rewrote the benchmark block of {readme}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few samples: a smoke test")
    parser.add_argument(
        "--only", default="", help=f"comma-separated sections of: {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--sessions", default="", help="concurrency levels, e.g. 10,50,100 (default: the plan's)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--readme", type=Path, default=None,
        help="rewrite this file's <!-- bench:start --> block (default: README.md when --out is"
             " docs/benchmarks.md; never with --quick)",
    )  # fmt: skip
    parser.add_argument("--no-readme", action="store_true", help="leave the README as it is")
    args = parser.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    plan = QUICK if args.quick else FULL
    if args.sessions:
        plan = replace(plan, sessions=tuple(int(n) for n in args.sessions.split(",")))
    readme = args.readme
    if readme is None and args.out.resolve() == DEFAULT_OUT and not only:
        readme = REPO / "README.md"
    if args.no_readme:
        readme = None
    command = "python bench/suite.py " + " ".join(sys.argv[1:])
    return asyncio.run(run(plan, only, args.out, command.strip(), readme))


if __name__ == "__main__":
    sys.exit(main())
