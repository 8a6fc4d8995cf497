"""Packages a session installs: ``%pip install name``, ``pip install`` in a shell cell.

The image is read-only and has no pip. Installs go into the session's own directory in the
workspace (``/workspace/.kernelhub/site-packages``, on ``sys.path`` from the start), so
they are the session's files: snapshots carry them and a restore (which restores files
before variables) brings them back. ``/workspace/.kernelhub/requirements.txt`` records
what was asked for and what got installed, one ``name==version`` a line.

Where packages come from is the operator's choice, never the open internet: the image's
own wheelhouse (``IMAGE_WHEELHOUSE``, seeded at build time from a requirements file), a
wheelhouse the gateway mounts read-only (``WHEELHOUSE``), and, if the operator set one,
a package index reached through the egress proxy under the session's egress policy
(``UV_INDEX_URL``). uv does the work (milliseconds for a small wheel; pip needs seconds
to start).

What the image already has at a compatible version is not installed again: the request
is resolved first with the image's packages as constraints, and only what is missing is
installed, without dependencies.

Run as ``python -m kernelhub_kernel.packages install NAME...`` (the ``pip`` on PATH).
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence

IMAGE_WHEELHOUSE = "/opt/kernelhub/wheelhouse"
WHEELHOUSE = "/opt/wheelhouse"
INDEX_ENV = "UV_INDEX_URL"
WORKSPACE_ENV = "KERNELHUB_WORKSPACE"
_NAME = re.compile(r"[-_.]+")


def session_dir(environ: Mapping[str, str] = os.environ) -> str:
    return os.path.join(environ.get(WORKSPACE_ENV, "/workspace"), ".kernelhub")


def site_dir(environ: Mapping[str, str] = os.environ) -> str:
    return os.path.join(session_dir(environ), "site-packages")


class _SessionPackages(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: an import nothing else found is looked up in the
    session's package directory, which may have appeared since the kernel started (the
    first install, or a restore that brought the workspace back)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or not os.path.isdir(self.path):
            return None  # a submodule: its package's __path__ finds it
        if self.path not in sys.path:
            sys.path.append(self.path)
        sys.path_importer_cache.pop(self.path, None)
        return importlib.machinery.PathFinder.find_spec(fullname, [self.path])


def activate(environ: Mapping[str, str] = os.environ) -> str:
    """Make the session's packages importable, after the image's (an install adds
    packages, it never shadows the kernel's own). Called at kernel start; the directory
    is made by the first install, so a workspace without installs stays as the user
    left it."""
    path = site_dir(environ)
    if os.path.isdir(path) and path not in sys.path:
        sys.path.append(path)
    sys.meta_path.append(_SessionPackages(path))
    return path


def normalize(name: str) -> str:
    return _NAME.sub("-", name).lower()


def image_packages() -> dict[str, str]:
    """Normalized name -> version of every distribution in the image's environment."""
    purelib = sysconfig.get_paths()["purelib"]
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=[purelib]):
        name = dist.metadata["Name"]
        if name:
            found[normalize(name)] = dist.version
    return found


def sources(environ: Mapping[str, str] = os.environ) -> list[str]:
    """uv's arguments for where packages come from; no index unless the operator set one."""
    args: list[str] = []
    for path in (IMAGE_WHEELHOUSE, WHEELHOUSE):
        if os.path.isdir(path):
            args += ["--find-links", path]
    if not environ.get(INDEX_ENV):
        args.append("--no-index")
    return args


def parse_pins(text: str) -> dict[str, str]:
    """``name==version`` lines (uv's resolution) -> normalized name -> version."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, _, version = line.partition("==")
            pins[normalize(name.split("[", 1)[0])] = version.split(";", 1)[0].strip()
    return pins


def missing(resolved: Mapping[str, str], present: Mapping[str, str]) -> list[str]:
    """What a resolution adds to an environment holding ``present``."""
    return [f"{n}=={v}" for n, v in sorted(resolved.items()) if present.get(n) != v]


def _uv() -> str:
    found = shutil.which("uv") or os.path.join(os.path.dirname(sys.executable), "uv")
    if not os.path.exists(found):
        raise SystemExit("uv is not in this image; rebuild it with `kernelhub image build`")
    return found


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("UV_CACHE_DIR", os.path.join(tempfile.gettempdir(), ".uv-cache"))
    env.setdefault("UV_LINK_MODE", "copy")  # the cache and the workspace are two tmpfs
    env["UV_NO_PROGRESS"] = "1"
    return env


def install(requirements: Sequence[str], *, quiet: bool = False) -> int:
    """Resolve ``requirements`` against the image, install what is missing; uv's status."""
    if not requirements:
        print("usage: pip install NAME [NAME ...]", file=sys.stderr)
        return 2
    uv, env, target = _uv(), _environment(), site_dir()
    os.makedirs(target, exist_ok=True)
    present = image_packages()
    present.update(_installed(target))
    with tempfile.TemporaryDirectory(prefix="kernelhub-pip-") as tmp:
        constraints = os.path.join(tmp, "constraints.txt")
        with open(constraints, "w") as f:
            f.write("".join(f"{n}=={v}\n" for n, v in present.items()))
        wanted = os.path.join(tmp, "requirements.in")
        with open(wanted, "w") as f:
            f.write("".join(f"{r}\n" for r in requirements))
        compiled = subprocess.run(
            [uv, "pip", "compile", "--quiet", "--python", sys.executable, *sources(env),
             "--constraint", constraints, wanted],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
        if compiled.returncode != 0:
            sys.stderr.write(compiled.stderr)
            return compiled.returncode
        todo = missing(parse_pins(compiled.stdout), present)
        if not todo:
            if not quiet:
                print("Requirements already satisfied: " + " ".join(requirements))
            return 0
        done = subprocess.run(
            [uv, "pip", "install", "--python", sys.executable, "--target", target,
             "--no-deps", *sources(env), *todo],
            env=env, check=False,
        )  # fmt: skip
    if done.returncode == 0:
        _record(requirements, todo)
        importlib.invalidate_caches()
    return done.returncode


def _installed(target: str) -> dict[str, str]:
    if not os.path.isdir(target):
        return {}
    return {
        normalize(d.metadata["Name"]): d.version
        for d in importlib.metadata.distributions(path=[target])
        if d.metadata["Name"]
    }


def _record(requested: Sequence[str], installed: Sequence[str]) -> None:
    with open(os.path.join(session_dir(), "requirements.txt"), "a") as f:
        f.write(f"# pip install {' '.join(requested)}\n")
        f.write("".join(f"{line}\n" for line in installed))


def pip_magic(line: str) -> None:
    """``%pip install NAME ...``: IPython's own ``%pip`` needs pip in the image."""
    main(line.split())


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["install"]:
        names = [a for a in args[1:] if not a.startswith("-")]
        return install(names, quiet="-q" in args or "--quiet" in args)
    if args[:1] in (["list"], ["freeze"]):
        for name, version in sorted({**image_packages(), **_installed(site_dir())}.items()):
            print(f"{name}=={version}")
        return 0
    print(
        "this sandbox's pip only installs (from the operator's wheelhouse or mirror) and "
        "lists: pip install NAME, pip list",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
