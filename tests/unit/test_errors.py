"""One exception tree, one table (as httpx proves its exception mapping): every exception
class kernelhub defines is inside ``KernelhubError``, is drawn in its tree's docstring, maps
to exactly one HTTP status and error kind in ``gateway/errors.py`` (the kind is also the
WebSocket ``error`` frame's), and the SDK reads every kind, status and close code the
gateway sends back as one class — the class whose server twin the row names."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

import kernelhub
from kernelhub import errors as core
from kernelhub.client import errors as client
from kernelhub.gateway.errors import (
    CLOSE_CODE_FOR_STATUS,
    STATUS_TABLE,
    close_code_for,
    row_for,
    status_for,
)
from kernelhub.wire import CloseCode


def _modules() -> list[ModuleType]:
    found = [kernelhub]
    for info in pkgutil.walk_packages(kernelhub.__path__, "kernelhub."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue  # runs the CLI
        found.append(importlib.import_module(info.name))
    return found


MODULES = _modules()


def _defined_exceptions() -> list[type[BaseException]]:
    classes = {
        obj
        for module in MODULES
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and obj.__module__ == module.__name__
    }
    return sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}")


DEFINED = _defined_exceptions()


def _tree(root: type[core.KernelhubError]) -> list[type[core.KernelhubError]]:
    seen: dict[type[core.KernelhubError], None] = {root: None}
    todo = [root]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen and sub.__module__.startswith("kernelhub"):
                seen[sub] = None
                todo.append(sub)
    return list(seen)


TREE = _tree(core.KernelhubError)
SERVER = [c for c in TREE if not issubclass(c, client.ClientError)]
KINDS = sorted({kind for _, _, kind in STATUS_TABLE} | {"internal"})


def test_the_walk_found_the_tree() -> None:
    # A walk that imported nothing would prove nothing.
    assert len(MODULES) > 80
    assert {core.SandboxStartError, client.SessionEndedError, core.UsageError} <= set(TREE)


@pytest.mark.parametrize("cls", DEFINED, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_exception_kernelhub_defines_is_inside_the_one_root(cls: type) -> None:
    if issubclass(cls, Warning):
        return  # a warning is not an error (sandbox/local.py's UnisolatedWarning)
    assert issubclass(cls, core.KernelhubError), (
        f"{cls.__module__}.{cls.__qualname__} derives from {cls.__mro__[1].__name__}, "
        "outside kernelhub.errors.KernelhubError"
    )


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__qualname__)
def test_every_class_is_drawn_in_its_trees_docstring(cls: type[core.KernelhubError]) -> None:
    drawn = (client.__doc__ or "") if issubclass(cls, client.ClientError) else core.__doc__
    assert f" {cls.__name__} " in (drawn or "").replace("\n", " "), (
        f"{cls.__name__} is missing from the tree in the docstring of "
        f"{'client/errors.py' if issubclass(cls, client.ClientError) else 'errors.py'}"
    )


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__qualname__)
def test_every_class_maps_to_exactly_one_row(cls: type[core.KernelhubError]) -> None:
    """The first row that matches decides; it must also be the most specific that
    matches, or the order of the table would hide a row from this class."""
    matching = [row for row in STATUS_TABLE if issubclass(cls, row[0])]
    assert matching, f"{cls.__name__} matches no row (not even KernelhubError)"
    first = matching[0][0]
    for row, status, kind in matching[1:]:
        assert issubclass(first, row) or (status, kind) == matching[0][1:], (
            f"{cls.__name__}: the row for {first.__name__} hides the row for {row.__name__} "
            f"({status} {kind}), which is not its ancestor"
        )
    assert row_for(cls) == matching[0][1:]


def test_a_kind_is_one_status() -> None:
    status_of: dict[str, set[int]] = {}
    for _, status, kind in STATUS_TABLE:
        status_of.setdefault(kind, set()).add(status)
    assert {kind: s for kind, s in status_of.items() if len(s) > 1} == {}


def test_no_row_is_dead() -> None:
    """Every row is the first match of its own class (else it could never answer)."""
    for row, status, kind in STATUS_TABLE:
        assert row_for(row) == (status, kind), f"the row for {row.__name__} is never reached"


def test_an_instance_gets_its_classs_row() -> None:
    assert status_for(core.SandboxStartError("no", log_tail="x")) == (503, "sandbox_failed")
    assert status_for(core.KernelDiedError("oom")) == (500, "internal")
    assert status_for(core.StorageFullError("full")) == (507, "storage_full")
    # An admin-only route refuses an authenticated caller with 403, not 401.
    assert status_for(core.AuthError("not admin", admin_required=True)) == (403, "forbidden")
    assert status_for(core.AuthError("who?")) == (401, "unauthorized")


# -- the SDK's side: every kind, status and close code back to one class ---------------

# Where the SDK deliberately has no server twin: its RateLimitedError's retry_after may be
# unknown (QuotaError's never is), StorageFullError and ServerError carry an ApiError's
# fields, and the 5xx kinds are all "the gateway failed".
NO_TWIN = {"too_many", "storage_full", *(k for _, s, k in STATUS_TABLE if s >= 500), "internal"}


@pytest.mark.parametrize("kind", KINDS)
def test_the_sdk_reads_every_kind_as_one_class(kind: str) -> None:
    status = next((s for _, s, k in STATUS_TABLE if k == kind), 500)
    by_kind = type(client.api_error(None, kind, "m"))
    by_status = type(client.api_error(status, kind, "m"))
    assert by_kind is by_status, (
        f"{kind}: {by_kind.__name__} by kind, {by_status.__name__} by status"
    )
    assert by_kind is not client.ApiError, f"the SDK does not know the kind {kind!r}"
    rows = [row for row, _, k in STATUS_TABLE if k == kind]
    if kind not in NO_TWIN:
        # A kind two rows share (conflict: SessionError and StoreError) has one twin.
        assert any(issubclass(by_kind, row) for row in rows), (
            f"{kind}: `except {rows[0].__name__}` does not catch the SDK's {by_kind.__name__}"
        )


@pytest.mark.parametrize("cls", SERVER, ids=lambda c: c.__qualname__)
def test_every_server_class_comes_back_as_one_sdk_class(cls: type[core.KernelhubError]) -> None:
    status, kind = row_for(cls)
    assert type(client.api_error(status, kind, "m")) is type(client.api_error(None, kind, "m"))


def test_the_stream_frame_kind_the_gateway_adds_is_known() -> None:
    # stream.py answers a frame it cannot parse with this kind, outside the table.
    assert type(client.api_error(None, "invalid_frame", "m")) is client.InvalidRequestError


def test_every_sdk_api_class_is_reachable() -> None:
    reached = {type(client.api_error(None, kind, "m")) for kind in [*KINDS, "invalid_frame"]}
    reached |= {type(client.api_error(s, "x", "m")) for s in range(400, 600)}
    api_classes = {c for c in TREE if issubclass(c, client.ApiError)}
    assert api_classes - reached == set()


@pytest.mark.parametrize("status", sorted(CLOSE_CODE_FOR_STATUS))
def test_every_close_code_comes_back_as_the_class_of_its_status(status: int) -> None:
    code = CLOSE_CODE_FOR_STATUS[status]
    sdk_status, sdk_kind = client.CLOSE_CODES[code]
    via_close = type(client.api_error(sdk_status, sdk_kind, "m"))
    # A close code is coarser than a status (4401 stands for 401 and 403): the class it
    # comes back as must catch the status's own class.
    assert issubclass(type(client.api_error(status, "x", "m")), via_close)
    assert via_close is not client.ApiError


@pytest.mark.parametrize("cls", SERVER, ids=lambda c: c.__qualname__)
def test_a_refused_stream_closes_with_its_statuss_code(cls: type[core.KernelhubError]) -> None:
    try:
        exc = cls("refused")
    except TypeError:  # AwaitingInput carries more; only its class matters here
        exc = cls.__new__(cls)
    code = close_code_for(exc)
    status, _ = row_for(cls)
    assert code == CLOSE_CODE_FOR_STATUS.get(status, CloseCode.POLICY)
    assert code in client.CLOSE_CODES  # the SDK ends the stream, not reconnects
