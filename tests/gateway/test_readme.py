"""The README's first two commands, run literally in a fresh clone with a fresh virtual
environment, then its command-line examples and every ```python block as written: the
README cannot drift from the code. The serve command runs against the real Docker daemon
with the already-built image. A ```python block that is not meant to run (a fragment, or
one needing packages kernelhub does not install) says so right above itself with
``<!-- not run: REASON -->``.

Slow by nature (a venv and two pip installs, from pip's cache): about two minutes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import RUN_INSTANCE, UNIT
from tests.gateway.conftest import free_port, remove_sandboxes

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
TOKEN_LINE = re.compile(r"created admin token 'admin' \(shown once\): (kh_\S+)")
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>[^>]*\S[^>]*) -->\n```python\n.*?```", re.S)
# What the Python examples print when they work: the sum streamed live, and again from the
# session restored from the snapshot; the execution's status, the KeyError's plain
# traceback, the interrupted sleep, the batch.
PYTHON_OUTPUT = [
    r"(?m)^6$[\s\S]*^6$",
    r"(?m)^[0-9a-f]{32} completed None$",
    r"KeyError: 'missing'",
    r"(?m)^interrupted$",
    r"\{'completed': 11\}",
]


def bash_blocks(readme: str, heading: str) -> list[str]:
    """The ```bash blocks of one ``## heading`` section, comments and blank lines dropped."""
    section = readme.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [
        "\n".join(line.split("  #", 1)[0].rstrip() for line in block.splitlines() if line.strip())
        for block in blocks
    ]


def python_blocks(readme: str) -> list[str]:
    """Every ```python block of the README, in order, except those marked not to run."""
    runnable = NOT_RUN.sub("", readme)
    return re.findall(r"```python\n(.*?)```", runnable, flags=re.S)


def run_python_blocks(readme: str, python: Path, cwd: Path, env: dict[str, str]) -> str:
    """Run each runnable ```python block as its own script, as a reader pastes it into a
    file; ``env`` carries KERNELHUB_URL and KERNELHUB_TOKEN, which the README has ``Hub()``
    read. Returns what they printed, together."""
    blocks = python_blocks(readme)
    skipped = NOT_RUN.findall(readme)
    assert len(blocks) >= 2 and len(skipped) <= 1, (len(blocks), skipped)
    printed = []
    for n, block in enumerate(blocks):
        script = cwd / f"readme_{n}.py"
        script.write_text(block)
        ran = subprocess.run(
            [str(python), script.name], cwd=cwd, env=env, capture_output=True, text=True,
            timeout=300 * UNIT,
        )  # fmt: skip
        # stderr too: an exception in the example's interrupt timer thread only prints there.
        assert ran.returncode == 0 and "Traceback" not in ran.stderr, (
            f"README python block {n}:\n{block}\n{ran.stdout}{ran.stderr}"
        )
        printed.append(ran.stdout)
    out = "".join(printed)
    missing = [pattern for pattern in PYTHON_OUTPUT if not re.search(pattern, out)]
    assert not missing and "\x1b[" not in out, (missing, out)
    return out


def clean_env(tmp: Path, port: int) -> dict[str, str]:
    """What a newcomer's shell has: no venv on PATH, nothing of ours on PYTHONPATH; plus a
    data dir, port and instance label of this test's own."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env["PATH"] = os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "activate").exists()
    )
    env.update(
        KERNELHUB_DATA_DIR=str(tmp / "data"),
        KERNELHUB_RUN_DIR="/run/kernelhub-test" if os.geteuid() == 0 else "/tmp/khrun",
        KERNELHUB_GATEWAY__PORT=str(port),
        KERNELHUB_GATEWAY__INSTANCE=f"{RUN_INSTANCE}-g",  # what remove_sandboxes() removes
        KERNELHUB_POOL__SIZE="0",
        # Only speed: pip skips byte-compiling the installed packages.
        PIP_NO_COMPILE="1",
    )
    return env


def test_the_readme_commands_work_in_a_fresh_clone(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    first = bash_blocks(readme, "Quick start")[0].splitlines()
    assert len(first) == 2, first
    run_command, test_command = first
    assert run_command.endswith("kernelhub serve") and test_command == "scripts/test"

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    port = free_port()
    env = clean_env(tmp_path, port)
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen(
            ["bash", "-c", run_command], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 600 * UNIT
        while not (found := TOKEN_LINE.search(log.read_text())):
            assert serve.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        said = log.read_text()
        assert "backend: docker" in said and "isolation:" in said and "Traceback" not in said

        # The command-line section, as written; only the two exports get this run's values.
        script = bash_blocks(readme, "Use it from the command line")[0]
        script = re.sub(
            r"^export KERNELHUB_URL=.*$",
            f"export KERNELHUB_URL=http://127.0.0.1:{port}",
            script,
            flags=re.M,
        )
        script = re.sub(
            r"^export KERNELHUB_TOKEN=.*$",
            f"export KERNELHUB_TOKEN={found.group(1)}",
            script,
            flags=re.M,
        )
        work = tmp_path / "work"
        work.mkdir()
        examples = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", f"export PATH={clone}/.venv/bin:$PATH\n{script}"],
            cwd=work, env=env, capture_output=True, text=True, timeout=300 * UNIT,
        )  # fmt: skip
        assert examples.returncode == 0, examples.stdout + examples.stderr
        assert "42\n" in examples.stdout and "Traceback" not in examples.stderr
        assert any(work.glob("*.ipynb"))

        # The Python examples, as written, against the same gateway and token.
        sdk_env = {**env, "KERNELHUB_URL": f"http://127.0.0.1:{port}"}
        sdk_env["KERNELHUB_TOKEN"] = found.group(1)
        run_python_blocks(readme, clone / ".venv" / "bin" / "python", work, sdk_env)
        # ... and the examples clean up after themselves: a reader can run them again.
        left = httpx.get(
            f"{sdk_env['KERNELHUB_URL']}/v1/sessions",
            headers={"Authorization": f"Bearer {found.group(1)}"},
            timeout=30,
        )
        assert left.json() == {"sessions": []}, left.text
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(10)
        remove_sandboxes()

    # The test command, cheaply: its own environment, ruff, mypy, then pytest collecting only.
    tests = subprocess.run(
        ["bash", "-c", f"{test_command} --collect-only -q tests/unit"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600 * UNIT,
    )  # fmt: skip
    assert tests.returncode == 0, (tests.stdout + tests.stderr)[-3000:]
    assert re.search(r"\d+ tests collected", tests.stdout), tests.stdout[-2000:]
