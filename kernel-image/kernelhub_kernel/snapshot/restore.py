"""One restore: workspace, imports, groups (each loaded as a unit), execution count."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import pickle
import re
import sys
import tempfile
import threading
from typing import Any

from .common import (
    _COPY_CHUNK,
    _PARALLEL_HASH_BYTES,
    FORMAT,
    IMPORTS,
    MANIFEST,
    WORKSPACE_TAR,
    _Clock,
)
from .picklers import _dill_unpickler_class
from .replay import rebuild
from .session import _Group, _Session
from .stream import TarReader
from .workspace import _extract_workspace, workspace_root

_GROUP_FILE = re.compile(r"groups/[0-9a-f]{16,64}\.pkl")


class _Restore:
    """From the snapshot directory ``path``, or (``streamed``) from what
    :func:`read_stream` received, held in memory."""

    def __init__(
        self,
        shell: Any,
        session: _Session,
        path: str | None,
        workspace: bool,
        streamed: _Streamed | None = None,
    ) -> None:
        self.shell = shell
        self.session = session
        self.path = path
        self.with_workspace = workspace
        self.streamed = streamed

    def run(self) -> dict[str, Any]:
        clock = _Clock()
        streamed = self.streamed
        if streamed is not None:
            clock.laps.update(streamed.timings)
            manifest = _check_manifest(streamed.manifest, "the stream")
        else:
            assert self.path is not None
            manifest = _read_manifest(self.path)
        ns = self.shell.user_ns
        failed: dict[str, str] = {}
        restored: list[str] = []
        workspace = None
        if self.with_workspace and manifest.get("workspace"):
            source: Any = self.path if streamed is None else streamed.workspace
            if source is None:
                failed["/workspace"] = "the stream had no workspace.tar"
            else:
                workspace = _extract_workspace(source, manifest["workspace"])
        clock.lap("workspace")
        imported: list[str] = []
        for name, spec in manifest["imports"].items():
            attr = spec.get("attr") or ""
            try:
                value: Any = importlib.import_module(spec["module"])
                for part in attr.split(".") if attr else []:
                    value = getattr(value, part)
            except Exception as exc:
                failed[name] = f"cannot import {spec.get('module')}: {type(exc).__name__}: {exc}"
                continue
            ns[name] = value
            imported.append(name)
            if attr and "." not in attr:
                self.session.tracker.from_imports[name] = (spec["module"], attr)
        clock.lap("imports")
        adopted: list[_Group] = []
        for entry in manifest["groups"]:
            values, failures = self._load_group(entry)
            failed.update(failures)
            restored.extend(values)
            if not failures:
                adopted.append(
                    _Group(
                        names=tuple(entry["names"]),
                        file=entry["file"],
                        sha256=entry["sha256"],
                        size_bytes=int(entry["size_bytes"]),
                        pickler=entry["pickler"],
                        pickle_bytes=int(entry["pickle_bytes"]),
                        buffers=[int(b) for b in entry["buffers"]],
                    )
                )
        clock.lap("groups")
        rebuilt, rebuild_failed = self._rebuild(manifest.get("rebuild") or {})
        failed.update(rebuild_failed)
        restored.extend(rebuilt)
        clock.lap("rebuild")
        self.shell.execution_count = int(manifest["execution_count"])
        # The next capture may use this directory as its base (a stream left none).
        self.session.snapshot_id = manifest["snapshot_id"] if streamed is None else None
        self.session.capture_path = self.path if streamed is None else None
        self.session.groups = adopted
        self.session.ids = {n: id(ns[n]) for g in adopted for n in g.names}
        self.session.workspace = manifest.get("workspace")
        self.session.tracker.reset()
        return {
            "format": FORMAT,
            "snapshot_id": manifest["snapshot_id"],
            "path": self.path,
            "restored": restored,
            "imports": imported,
            "failed": failed,
            "skipped": {
                k: v
                for k, v in manifest.get("skipped", {}).items()
                if k not in rebuilt and k not in rebuild_failed
            },
            "rebuilt": rebuilt,
            "execution_count": self.shell.execution_count,
            "workspace": workspace,
            "timings": clock.laps,
        }

    def _rebuild(self, plan: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
        """Re-run the cells the capture planned (``replay``); the cells that made
        something go into this kernel's cell log, so a later snapshot can do it again."""
        if not isinstance(plan, dict) or not plan:
            return {}, {}
        rebuilt, failed = rebuild(plan, self.shell.user_ns)
        module = sys.modules.get("kernelhub_kernel.cell_log")
        log = module.log() if module is not None else None
        if log is not None and rebuilt:
            log.inherit(
                [
                    module.Cell(index=int(i), source=str(e["code"]), success=True)
                    for i, e in sorted(plan.items(), key=lambda item: int(item[0]))
                    if set(e.get("names", [])) & rebuilt.keys()
                ]
            )
        return rebuilt, failed

    def _load_group(self, entry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        names: list[str] = list(entry["names"])
        try:
            if self.streamed is not None:
                data, buffers, digest = self.streamed.group(entry)
            else:
                assert self.path is not None
                data, buffers, digest = _read_group_file(self.path, entry)
        except Exception as exc:
            reason = f"group file {entry.get('file')!r} unusable: {exc}"
            return {}, dict.fromkeys(names, reason)
        values, failures = self._unpickle(entry, names, data, buffers)
        try:
            digest.check()
        except ValueError as exc:
            ns = self.shell.user_ns
            for name in values:
                ns.pop(name, None)
            reason = f"group file {entry.get('file')!r} unusable: {exc}"
            return {}, dict.fromkeys(names, reason)
        return values, failures

    def _unpickle(
        self, entry: dict[str, Any], names: list[str], data: Any, buffers: list[Any]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        stream = io.BytesIO(data)
        if entry["pickler"] == "dill":
            unpickler: Any = _dill_unpickler_class()(stream, buffers=iter(buffers), ignore=True)
            unpickler._main = self.shell.user_module
        else:
            unpickler = pickle.Unpickler(stream, buffers=iter(buffers))
        values: dict[str, Any] = {}
        ns = self.shell.user_ns
        for index, name in enumerate(names):
            try:
                values[name] = ns[name] = unpickler.load()
                # Bound at once, as when the cells ran: rebuilding a later member (a
                # subclass's __init_subclass__, a default argument) may look it up.
            except Exception as exc:
                reason = f"cannot be loaded: {type(exc).__name__}: {exc}"[:500]
                failures = {name: reason}
                for later in names[index + 1 :]:
                    failures[later] = f"not loaded: {name} before it in the same group failed"
                return values, failures
        return values, {}


def _read_manifest(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MANIFEST), "rb") as f:
        return _check_manifest(json.load(f), path)


def _check_manifest(manifest: Any, path: str) -> dict[str, Any]:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}/{MANIFEST} is not a {FORMAT} manifest")
    for key, kind in (
        ("snapshot_id", str),
        ("execution_count", int),
        ("imports", dict),
        ("groups", list),
    ):
        if not isinstance(manifest.get(key), kind):
            raise ValueError(f"{path}/{MANIFEST}: {key!r} missing or not a {kind.__name__}")
    return manifest


def _read_group_file(path: str, entry: dict[str, Any]) -> tuple[bytes, list[bytearray], _Digest]:
    """The pickle and its buffers, and the check of their sha256 against the manifest.

    A large file is hashed from its own file descriptor in a thread, while it is read and
    unpickled here (both release the GIL): ``_Digest.check`` waits for it.
    """
    name = entry["file"]
    if not isinstance(name, str) or not _GROUP_FILE.fullmatch(name):
        raise ValueError("not a group file name")
    pickle_bytes = int(entry["pickle_bytes"])
    lengths = [int(n) for n in entry["buffers"]]
    file_path = os.path.join(path, name)
    with open(file_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != pickle_bytes + sum(lengths):
            raise ValueError(f"{size} bytes, the manifest says {pickle_bytes + sum(lengths)}")
        digest = _Digest(entry["sha256"], file_path if size >= _PARALLEL_HASH_BYTES else None)
        data = f.read(pickle_bytes)
        digest.update(data)
        buffers = []
        for length in lengths:
            buffer = bytearray(length)
            view = memoryview(buffer)
            done = 0
            while done < length:
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError("file ends early")
                done += n
            digest.update(buffer)
            buffers.append(buffer)
    return data, buffers, digest


class _Digest:
    """sha256 of a group file: computed inline for a small one, in a thread for a large
    one (from the file, not from the buffers the unpickled objects now own)."""

    def __init__(self, expected: str, path: str | None) -> None:
        # "" (a streamed capture's entries): nothing to check here, the host checked
        # the whole stream against its MAC.
        self._expected = expected
        if not expected:
            path = None
        self._hash = hashlib.sha256()
        self._thread: threading.Thread | None = None
        if path is not None:
            self._thread = threading.Thread(
                target=self._hash_file, args=(path,), name="kernelhub-snapshot-hash"
            )
            self._thread.start()

    def _hash_file(self, path: str) -> None:
        with open(path, "rb") as f:
            while chunk := f.read(_COPY_CHUNK * 4):
                self._hash.update(chunk)

    def update(self, data: bytes | bytearray) -> None:
        if self._thread is None and self._expected:
            self._hash.update(data)

    def check(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._expected and self._hash.hexdigest() != self._expected:
            raise ValueError("content does not match its sha256 (corrupted or altered)")


class _Streamed:
    """A snapshot received over a stream (``stream.TarReader``), held until the host's
    verdict: group files as one buffer each (the pickle's out-of-band buffers are views
    into it, adopted by the objects without a copy), the manifest, and the workspace
    tar in an unnamed file on the workspace's disk."""

    def __init__(self) -> None:
        self.files: dict[str, list[bytearray]] = {}
        self.manifest: Any = None
        self.workspace: Any = None
        self.timings: dict[str, float] = {}
        self.importer: threading.Thread | None = None

    def group(self, entry: dict[str, Any]) -> tuple[Any, list[Any], _Digest]:
        name = entry["file"]
        if not isinstance(name, str) or not _GROUP_FILE.fullmatch(name):
            raise ValueError("not a group file name")
        parts = self.files.pop(name, None)
        if parts is None:
            raise ValueError("not in the stream")
        pickle_bytes = int(entry["pickle_bytes"])
        lengths = [int(n) for n in entry["buffers"]]
        size = sum(len(p) for p in parts)
        if size != pickle_bytes + sum(lengths):
            raise ValueError(f"{size} bytes, the manifest says {pickle_bytes + sum(lengths)}")
        # Not hashed again here, whatever the entry says: the host checked the whole
        # stream against its MAC before saying yes.
        digest = _Digest("", None)
        if [len(p) for p in parts] == [pickle_bytes, *lengths]:
            return parts[0], parts[1:], digest
        # One buffer for the whole file (a blob packed from a directory): each part gets
        # its own copy, aligned, as numpy wants its arrays.
        view = memoryview(parts[0])
        buffers = []
        offset = pickle_bytes
        for length in lengths:
            buffers.append(bytearray(view[offset : offset + length]))
            offset += length
        return view[:pickle_bytes], buffers, digest


def _import_meanwhile(modules: Any) -> threading.Thread:
    """Import the snapshot's modules (numpy, pandas ...: a large part of a restore into a
    fresh kernel) in a thread while the groups arrive; what fails here is reported by the
    restore's own imports later.

    This happens before the host's verdict: a blob edited on disk could make this fresh
    kernel import any module already installed in it (and nothing else: names only, no
    pickle is loaded before the verdict), which the session's own code may do anyway."""

    def run() -> None:
        for module in modules if isinstance(modules, list) else []:
            if isinstance(module, str) and all(p.isidentifier() for p in module.split(".")):
                with contextlib.suppress(Exception):
                    importlib.import_module(module)

    thread = threading.Thread(target=run, name="kernelhub-snapshot-imports", daemon=True)
    thread.start()
    return thread


def read_stream(reader: TarReader) -> _Streamed:
    """Receive every member; raise (loading nothing) unless the host's verdict is yes."""
    clock = _Clock()
    got = _Streamed()
    try:
        for name, size, parts in reader.members():
            if _GROUP_FILE.fullmatch(name):
                if parts is None or sum(parts) != size:
                    parts = [size]
                buffers = [bytearray(n) for n in parts]
                for buffer in buffers:
                    reader.read_into(memoryview(buffer))
                got.files[name] = buffers
            elif name == MANIFEST:
                got.manifest = json.loads(bytes(reader.read(size)))
            elif name == IMPORTS and got.importer is None:
                got.importer = _import_meanwhile(json.loads(bytes(reader.read(size))))
            elif name == WORKSPACE_TAR:
                root = workspace_root()
                os.makedirs(root, exist_ok=True)
                got.workspace = tempfile.TemporaryFile(dir=root)  # noqa: SIM115 - closed by the caller
                reader.copy_to(got.workspace, size)
                got.workspace.seek(0)
            else:
                reader.skip(size)
        if got.importer is not None:
            got.importer.join()  # before anything unpickles: no import races it
        if not reader.verdict():
            raise ValueError(
                "the host refused this snapshot (its integrity check failed); nothing loaded"
            )
    except BaseException:
        if got.workspace is not None:
            got.workspace.close()
        raise
    clock.lap("receive")
    got.timings = clock.laps
    return got
