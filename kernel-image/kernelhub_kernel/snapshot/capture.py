"""One capture: classify the namespace, group, pickle what changed, write, report."""

from __future__ import annotations

import builtins
import functools
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import threading
import time
import types
import uuid
import warnings
from typing import Any

from .common import (
    _MISSING,
    _PARALLEL_HASH_BYTES,
    FORMAT,
    GROUPS_DIR,
    IMPORTS,
    MANIFEST,
    MAX_REACH_OBJECTS,
    SCAN_LIMIT_BYTES,
    SMALL_GROUP_BYTES,
    WORKSPACE_TAR,
    _Clock,
    _describe_error,
    _MemberFailed,
    _NeedsDill,
    _prepare_dir,
    _Refused,
    _session_key,
    _write_atomic,
    _write_parts,
)
from .grouping import _import_ref, _Reacher, _Refs
from .picklers import _CPickler, _dill_pickler, _dill_warning_class, _global_refs, _Pickled
from .reducers import _Reducer
from .session import _Group, _Session
from .stream import TarWriter
from .workspace import _scan_workspace, _write_workspace_tar, workspace_root

_IPYTHON_NAME = re.compile(r"_+|_i+|_i\d+|_\d+|_ih|_oh|_dh|In|Out|_exit_code")
_MODULE_DUNDERS = frozenset(
    {"__builtins__", "__builtin__", "__name__", "__doc__", "__package__", "__loader__", "__spec__"}
)


class _Capture:
    """One capture: classify the namespace, group, pickle what changed, write, report."""

    @functools.cached_property
    def reacher(self) -> _Reacher:
        return _Reacher(self.shell, self.refs)

    @functools.cached_property
    def reducers(self) -> dict[bool, _Reducer]:
        return {mode: _Reducer(self.shell, self.refs, dill_mode=mode) for mode in (False, True)}

    def __init__(
        self,
        shell: Any,
        session: _Session,
        path: str,
        base: str | None,
        stream: TarWriter | None = None,
    ) -> None:
        self.shell = shell
        self.session = session
        self.path = path
        # Streamed (``stream``): always full, nothing written in the sandbox, and this
        # kernel's memory of its last capture is left alone, so the next checkpoint is
        # still incremental on the last checkpoint directory.
        self.stream = stream
        if stream is not None:
            base = None
        self.base = os.path.abspath(base) if base else None
        self.ns: dict[str, Any] = shell.user_ns
        self.refs = _Refs()
        self.session_key = _session_key(shell)
        self.warnings: list[str] = []
        self.written_bytes = 0
        # Set by _plan: the object ids each planned group reaches (kept for the next
        # capture), and the variables that reach a namespace dict (dill maps those).
        self._reach_of: dict[tuple[str, ...], frozenset[int]] = {}
        self._force_dill: set[str] = set()
        # Set by _dirty: small clean groups (by id), pickled again to compare digests.
        self._recheck: set[int] = set()
        self._verified = {g.sha256 for g in session.groups}

    def run(self) -> dict[str, Any]:
        clock = _Clock()
        if self.stream is None:
            _prepare_dir(self.path)
        variables, imports, skipped = self._classify()
        if self.stream is not None:
            modules = sorted({spec["module"] for spec in imports.values()})
            self.stream.add_parts(IMPORTS, [memoryview(json.dumps(modules).encode())])
        incremental, full_reason = self._check_base()
        tracker = self.session.tracker
        dirty = self._dirty(variables, incremental)
        clock.lap("classify")
        plan = self._plan(variables, dirty, incremental)
        clock.lap("group")
        groups: list[tuple[_Group, bool]] = []
        for names, reuse in plan:
            if reuse is not None:
                if id(reuse) not in self._recheck and self._link(reuse):
                    groups.append((reuse, True))
                    continue
                names = [n for n in variables if n in set(reuse.names)]
                if reuse.reach is not None:
                    self._reach_of[tuple(names)] = reuse.reach
            written, failures = self._write_group(names, variables)
            skipped.update(failures)
            if written is not None:
                groups.append(written)
        clock.lap("pickle_and_write")
        workspace = self._workspace(incremental)
        clock.lap("workspace")
        rebuild: dict[str, Any] = {}
        cells = _cell_log()
        if cells is not None and skipped:
            available = {n for g, _ in groups for n in g.names} | set(imports)
            rebuild, skipped = self.session.planner.plan(
                cells, skipped, available, self.ns, self.shell.transform_cell
            )
        clock.lap("rebuild_plan")
        snapshot_id = uuid.uuid4().hex
        manifest = {
            "format": FORMAT,
            "snapshot_id": snapshot_id,
            "base_snapshot_id": self.session.snapshot_id if incremental else None,
            "created": time.time(),
            "python": sys.version.split()[0],
            "execution_count": int(self.shell.execution_count),
            "imports": imports,
            "groups": [g.entry(reused) for g, reused in groups],
            "skipped": skipped,
            "rebuild": rebuild,
            "workspace": workspace,
        }
        # Compact: with ``indent`` json uses its pure-Python encoder, ~0.3 ms a checkpoint.
        manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        self.written_bytes += len(manifest_bytes)
        if self.stream is not None:
            self.stream.add_parts(MANIFEST, [memoryview(manifest_bytes)])
            self.stream.close()
        else:
            _write_atomic(os.path.join(self.path, MANIFEST), manifest_bytes)
            self.session.snapshot_id = snapshot_id
            self.session.capture_path = self.path
            self.session.groups = [g for g, _ in groups]
            self.session.ids = {n: id(v) for n, v in variables.items()}
            self.session.workspace = workspace
            tracker.reset()
        self.refs.clear()
        clock.lap("manifest")

        group_bytes = sum(g.size_bytes for g, _ in groups)
        workspace_bytes = workspace["size_bytes"] if workspace else 0
        saved = [n for g, _ in groups for n in g.names]
        files = [MANIFEST, *sorted({g.file for g, _ in groups})]
        if workspace:
            files.append(workspace["file"])
        return {
            "format": FORMAT,
            "snapshot_id": snapshot_id,
            "path": self.path,
            "base": self.base,
            "incremental": incremental,
            "full_reason": full_reason,
            "saved": saved,
            "imports": imports,
            "skipped": skipped,
            "execution_count": manifest["execution_count"],
            "size_bytes": group_bytes + workspace_bytes + len(manifest_bytes),
            "written_bytes": self.written_bytes,
            "sizes": {
                "groups": group_bytes,
                "workspace": workspace_bytes,
                "manifest": len(manifest_bytes),
            },
            "groups": [g.entry(reused) for g, reused in groups],
            "workspace": workspace,
            "files": files,
            "warnings": self.warnings,
            "timings": clock.laps,
        }

    # --- what to save -------------------------------------------------------------------

    def _classify(self) -> tuple[dict[str, Any], dict[str, dict[str, str]], dict[str, str]]:
        """Split the namespace into variables to pickle, imports, and skipped names."""
        hidden = self.shell.user_ns_hidden
        from_imports = self.session.tracker.from_imports
        variables: dict[str, Any] = {}
        imports: dict[str, dict[str, str]] = {}
        skipped: dict[str, str] = {}
        for name, value in list(self.ns.items()):
            if name in _MODULE_DUNDERS or _IPYTHON_NAME.fullmatch(name):
                continue
            if name in hidden and hidden[name] is value:
                continue
            if getattr(builtins, name, _MISSING) is value:
                continue  # confirm, print...: the restoring kernel has them as builtins
            if isinstance(value, types.ModuleType):
                module_name = getattr(value, "__name__", None)
                if isinstance(module_name, str) and sys.modules.get(module_name) is value:
                    imports[name] = {"module": module_name}
                else:
                    skipped[name] = (
                        "module object that is not importable by name (made at run time);"
                        " modules come back by import only"
                    )
                continue
            ref = _import_ref(value)
            if ref is None and name in from_imports:
                module_name, attr = from_imports[name]
                module = sys.modules.get(module_name)
                if module is not None and getattr(module, attr, _MISSING) is value:
                    ref = (module_name, attr)
            if ref is not None:
                imports[name] = {"module": ref[0], "attr": ref[1]}
                continue
            if self.session_key and isinstance(value, (bytes, str)):
                raw = value.encode() if isinstance(value, str) else value
                if raw == self.session_key:
                    skipped[name] = "the kernel's session key: a snapshot never carries it"
                    continue
            variables[name] = value
        return variables, imports, skipped

    def _check_base(self) -> tuple[bool, str | None]:
        if self.base is None:
            return False, "no base"
        if self.session.snapshot_id is None:
            return False, "this kernel has no previous snapshot"
        try:
            with open(os.path.join(self.base, MANIFEST), "rb") as f:
                base_id = json.load(f).get("snapshot_id")
        except (OSError, ValueError, AttributeError) as exc:
            return False, f"cannot read the base manifest: {exc}"
        if base_id != self.session.snapshot_id:
            return False, "base is not this kernel's latest snapshot"
        if os.path.samefile(self.base, self.path):
            return False, "base is the target directory"
        return True, None

    def _dirty(self, variables: dict[str, Any], incremental: bool) -> set[str]:
        tracker = self.session.tracker
        if not incremental:
            return set(variables)
        if tracker.all_dirty:
            self.warnings.append(
                "a cell did something the tracker cannot follow (exec, globals(), an unknown"
                " magic, a foreign silent execute): every group was pickled again"
            )
            return set(variables)
        dirty = tracker.names & variables.keys()
        ids = self.session.ids
        dirty.update(n for n, v in variables.items() if ids.get(n) != id(v))
        for group in self.session.groups:
            members = [n for n in group.names if n in variables]
            if len(members) != len(group.names) or dirty.intersection(members):
                dirty.update(members)
            elif group.size_bytes < SMALL_GROUP_BYTES and not all(
                _is_code(variables[n]) for n in members
            ):
                # Not seen changing, but cheap to check: pickled again, and reused if
                # the digest did not change (its grouping is kept: see _plan). Code
                # (functions, classes) changes only in ways the tracker sees.
                self._recheck.add(id(group))
        return dirty

    def _plan(
        self, variables: dict[str, Any], dirty: set[str], incremental: bool
    ) -> list[tuple[list[str], _Group | None]]:
        """Group the variables: connected components of shared objects.

        Units are dirty variables (traversed now) and clean groups (their object sets
        from the last capture). A component that is exactly one clean group is reused.
        """
        units: list[tuple[list[str], _Group | None, set[int] | frozenset[int]]] = []
        force_dill: set[str] = set()
        for name in variables:
            if name in dirty:
                found = self.reacher.reach(variables[name])
                if found.truncated:
                    self.warnings.append(
                        f"{name}: more than {MAX_REACH_OBJECTS} objects; sharing with other"
                        " variables beyond them is not checked"
                    )
                if found.namespace:
                    force_dill.add(name)
                units.append(([name], None, found.ids))
        if incremental:
            for group in self.session.groups:
                if dirty.intersection(group.names):
                    continue
                if group.reach is None:
                    ids: set[int] = set()
                    for name in group.names:
                        ids |= self.reacher.reach(variables[name]).ids
                    group.reach = frozenset(ids)
                units.append((list(group.names), group, group.reach))
        parent = list(range(len(units)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[int, int] = {}
        all_ids: set[int] = set()
        for index, (_, _, ids_) in enumerate(units):
            for shared in ids_ & all_ids:
                a, b = find(index), find(owner[shared])
                if a != b:
                    parent[a] = b
            owner.update(dict.fromkeys(ids_, index))
            all_ids |= ids_
        components: dict[int, list[int]] = {}
        for index in range(len(units)):
            components.setdefault(find(index), []).append(index)
        order = {name: i for i, name in enumerate(variables)}
        plan: list[tuple[list[str], _Group | None]] = []
        self._force_dill = force_dill
        for members in components.values():
            if len(members) == 1 and units[members[0]][1] is not None:
                plan.append((units[members[0]][0], units[members[0]][1]))
                continue
            names = sorted((n for m in members for n in units[m][0]), key=order.__getitem__)
            reach: set[int] = set()
            for m in members:
                reach |= units[m][2]
            self._reach_of[tuple(names)] = frozenset(reach)
            plan.append((names, None))
        plan.sort(key=lambda item: order.get(item[0][0], 0) if item[0] else 0)
        return plan

    # --- writing groups -----------------------------------------------------------------

    def _link(self, group: _Group) -> bool:
        """Reuse an unchanged group's file from base: hard link, else copy."""
        assert self.base is not None
        source = os.path.join(self.base, group.file)
        target = os.path.join(self.path, group.file)
        if os.path.exists(target):
            return True
        try:
            os.link(source, target)
        except FileNotFoundError:
            return False
        except OSError:
            try:
                shutil.copyfile(source, target)
            except OSError:
                return False
            self.written_bytes += group.size_bytes
        return True

    def _write_group(
        self, names: list[str], variables: dict[str, Any]
    ) -> tuple[tuple[_Group, bool] | None, dict[str, str]]:
        """Pickle ``names`` together; members that cannot be pickled are dropped, named."""
        pending = list(names)
        failures: dict[str, str] = {}
        use_dill = bool(self._force_dill.intersection(pending))
        # The C pickler's message is usually the clearer one when dill fails too.
        c_errors: dict[str, str] = {}
        while pending:
            try:
                pickled = self._pickle([variables[n] for n in pending], use_dill)
            except _MemberFailed as exc:
                name = pending[exc.index]
                cause = exc.cause
                if not isinstance(cause, _Refused) and not use_dill:
                    if not isinstance(cause, _NeedsDill):
                        c_errors[name] = _describe_error(cause)
                    use_dill = True
                    continue
                failures[name] = c_errors.get(name) or _describe_error(cause)
                pending.pop(exc.index)
                use_dill = bool(self._force_dill.intersection(pending))
                continue
            # A pickle identical to one written before was verified then. (Not asked
            # when streaming: that would hash it here, and the host hashes the stream.)
            known = (
                self.stream is None
                and pickled.size < _PARALLEL_HASH_BYTES
                and pickled.digest() in self._verified
            )
            problems = [] if known else self._verify(pickled.data)
            if problems:
                bad = self._attribute_problems(pending, variables, use_dill)
                if not bad:
                    bad = dict.fromkeys(pending, problems[0])
                failures.update(bad)
                pending = [n for n in pending if n not in bad]
                continue
            return self._store(tuple(pending), pickled, names), failures
        return None, failures

    def _pickle(self, values: list[Any], use_dill: bool) -> _Pickled:
        out = io.BytesIO()
        buffers: list[pickle.PickleBuffer] = []
        reducer = self.reducers[use_dill]
        if use_dill:
            pickler: Any = _dill_pickler(out, buffers, reducer, self.shell.user_module)
        else:
            pickler = _CPickler(out, buffers, reducer)
        dill_warning = _dill_warning_class() if use_dill else None
        with warnings.catch_warnings():
            if dill_warning is not None:
                # dill warns, then falls back to a by-reference global that fails at load.
                warnings.simplefilter("error", dill_warning)
            for index, value in enumerate(values):
                try:
                    pickler.dump(value)
                except Exception as exc:
                    raise _MemberFailed(index, exc) from exc
        raws = []
        for buffer in buffers:
            try:
                raws.append(buffer.raw())
            except BufferError:
                # Not contiguous: numpy only hands out contiguous buffers, but be safe.
                raws.append(memoryview(bytes(buffer)))
        return _Pickled(out.getvalue(), raws, "dill" if use_dill else "pickle")

    def _verify(self, raw: bytes) -> list[str]:
        """Problems that would make the pickle fail or leak at restore (cheap checks)."""
        problems: list[str] = []
        if self.session_key and len(self.session_key) >= 16 and raw.find(self.session_key) >= 0:
            problems.append("contains the kernel's session key: a snapshot never carries it")
        if raw.find(b"__main__") >= 0:
            if len(raw) > SCAN_LIMIT_BYTES:
                self.warnings.append(
                    f"a {len(raw)}-byte pickle was not scanned for __main__ references"
                    " (reducers still refuse them)"
                )
            else:
                for module, name in _global_refs(raw):
                    if module == "__main__" and name != "__dict__":
                        problems.append(
                            f"refers to __main__.{name} by reference, which will not exist"
                            " when the snapshot is loaded in a fresh kernel"
                        )
        return problems

    def _attribute_problems(
        self, names: list[str], variables: dict[str, Any], use_dill: bool
    ) -> dict[str, str]:
        bad: dict[str, str] = {}
        for name in names:
            try:
                alone = self._pickle([variables[name]], use_dill)
            except _MemberFailed as exc:
                bad[name] = _describe_error(exc.cause)
                continue
            problems = self._verify(alone.data)
            if problems:
                bad[name] = problems[0]
        return bad

    def _store(
        self, names: tuple[str, ...], pickled: _Pickled, planned: list[str]
    ) -> tuple[_Group, bool]:
        """Hash, then write unless an identical file exists in base or here already.
        Streamed: sent as it is, unhashed (the host's hash of the stream is the one)."""
        parts = [memoryview(pickled.data), *pickled.buffers]
        size = pickled.size
        if self.stream is not None:
            group = _Group(
                names=names,
                file=f"{GROUPS_DIR}/{uuid.uuid4().hex}.pkl",
                sha256="",
                size_bytes=size,
                pickler=pickled.pickler,
                pickle_bytes=len(pickled.data),
                buffers=[b.nbytes for b in pickled.buffers],
            )
            self.stream.add_parts(group.file, parts)
            self.written_bytes += size
            return group, False
        tmp = os.path.join(self.path, GROUPS_DIR, f".tmp-{uuid.uuid4().hex}")
        writer: threading.Thread | None = None
        write_error: list[BaseException] = []
        if size >= _PARALLEL_HASH_BYTES:
            # Write while hashing: both release the GIL, and the sha256 names the file.
            def write() -> None:
                try:
                    _write_parts(tmp, parts)
                except BaseException as exc:
                    write_error.append(exc)

            writer = threading.Thread(target=write, name="kernelhub-snapshot-write")
            writer.start()
        sha = pickled.digest()
        if writer is not None:
            writer.join()
            if write_error:
                raise write_error[0]
        group = _Group(
            names=names,
            file=f"{GROUPS_DIR}/{sha[:32]}.pkl",
            sha256=sha,
            size_bytes=size,
            pickler=pickled.pickler,
            pickle_bytes=len(pickled.data),
            buffers=[b.nbytes for b in pickled.buffers],
            reach=self._reach_of.get(tuple(planned)),
        )
        target = os.path.join(self.path, group.file)
        reused = False
        if os.path.exists(target):
            reused = True
        elif self.base is not None and os.path.exists(os.path.join(self.base, group.file)):
            # Content-addressed: a file of that name in base has this very content.
            reused = self._link(group)
        if reused:
            if writer is not None:
                os.unlink(tmp)
            return group, True
        if writer is None:
            _write_parts(tmp, parts)
        os.replace(tmp, target)
        self.written_bytes += size
        return group, False

    # --- workspace ----------------------------------------------------------------------

    def _workspace(self, incremental: bool) -> dict[str, Any] | None:
        root = workspace_root()
        if not os.path.isdir(root):
            return None
        entries, skipped = _scan_workspace(root, exclude=self.path)
        fingerprint = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
        if self.stream is not None:
            # An unnamed file (O_TMPFILE) on the workspace's own disk: no tmpfs to fill,
            # and invisible to the scan.
            with tempfile.TemporaryFile(dir=root) as f:
                _, files, size, more_skipped = _write_workspace_tar(f, root, entries)
                self.stream.add_file(WORKSPACE_TAR, f)
            self.written_bytes += size
            return {
                "file": WORKSPACE_TAR,
                "sha256": "",
                "size_bytes": size,
                "files": files,
                "fingerprint": fingerprint,
                "skipped": skipped + more_skipped,
                "reused": False,
            }
        previous = self.session.workspace
        target = os.path.join(self.path, WORKSPACE_TAR)
        if incremental and previous and previous.get("fingerprint") == fingerprint:
            assert self.base is not None
            try:
                os.link(os.path.join(self.base, WORKSPACE_TAR), target)
                return {**previous, "reused": True}
            except OSError:
                pass
        tmp = target + ".tmp"
        sha, files, size, more_skipped = _write_workspace_tar(tmp, root, entries)
        os.replace(tmp, target)
        self.written_bytes += size
        return {
            "file": WORKSPACE_TAR,
            "sha256": sha,
            "size_bytes": size,
            "files": files,
            "fingerprint": fingerprint,
            "skipped": skipped + more_skipped,
            "reused": False,
        }


def _cell_log() -> list[Any] | None:
    """The cells this kernel ran, if the launcher installed the log (not imported
    here: the log is its own module, installed before the first cell)."""
    module = sys.modules.get("kernelhub_kernel.cell_log")
    log = module.log() if module is not None else None
    return list(log.cells) if log is not None else None


def _is_code(value: Any) -> bool:
    return isinstance(value, (type, types.FunctionType, functools._lru_cache_wrapper))
