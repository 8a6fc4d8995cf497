"""kernelhub's own seccomp profile: load it, reason about it, compile it for bubblewrap.

Docker's default profile (20.10) still lets a container open AF_VSOCK sockets, which on a
VM host talk to the hypervisor side, and set up io_uring, whose queued operations (open,
connect, even socket creation) run in the kernel without passing through seccomp at all.
So every sandbox gets ``seccomp.json`` (next to this module) instead: Moby's allowlist for
a container without capabilities, minus io_uring and a few other calls, with ``socket``,
``socketpair``, ``clone`` and ``personality`` narrowed by their arguments.

The profile names only 64-bit architectures, so a syscall made through the 32-bit (int 0x80)
or x32 ABI kills the process with SIGSYS instead of reaching a rule: the compat ABIs carry
multiplexers such as ``socketcall`` whose arguments sit in memory, out of seccomp's sight.
With the x86 ABI listed and ``socketcall`` allowed, as in Moby's profile, int 0x80 opens
an AF_VSOCK socket even where the ``socket`` rules refuse one.

The file is in the Docker/OCI format, so one artefact serves both backends:

* Docker takes it as ``security_opt=["seccomp=" + profile_json()]``;
* the local backend hands ``compile_bpf()``'s output to ``bwrap --seccomp FD``.

``evaluate()`` / ``is_denied()`` are a small, pure model of how runc applies the file
(first rule whose conditions hold decides; otherwise ``defaultAction``), so tests can
state the policy as data without loading a filter. They and ``compile_bpf()`` read the
profile through one parser, so the model and the real filter cannot drift apart.

Nothing here touches libseccomp until ``compile_bpf()`` is called.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from kernelhub.errors import BackendUnavailableError, SandboxError

SECCOMP_PROFILE_VERSION: Final[int] = 1
"""Bumped on every change to ``seccomp.json``, so a sandbox's labels say which rules it
runs under. ``tests/unit/sandbox/test_seccomp.py`` pins the file's fingerprint per
version and fails when the file changes without a bump."""

PROFILE_PATH: Final[Path] = Path(__file__).with_name("seccomp.json")

_U64: Final[int] = (1 << 64) - 1
_MAX_ARGS: Final[int] = 6  # a Linux syscall has at most six arguments

_OPS: Final[frozenset[str]] = frozenset(
    {
        "SCMP_CMP_EQ",
        "SCMP_CMP_NE",
        "SCMP_CMP_LT",
        "SCMP_CMP_LE",
        "SCMP_CMP_GT",
        "SCMP_CMP_GE",
        "SCMP_CMP_MASKED_EQ",
    }
)
# runc treats SCMP_ACT_KILL as "kill the thread"; TRACE without a tracer fails with ENOSYS.
_ACTIONS: Final[frozenset[str]] = frozenset(
    {
        "SCMP_ACT_ALLOW",
        "SCMP_ACT_LOG",
        "SCMP_ACT_ERRNO",
        "SCMP_ACT_KILL",
        "SCMP_ACT_KILL_THREAD",
        "SCMP_ACT_KILL_PROCESS",
        "SCMP_ACT_TRAP",
        "SCMP_ACT_TRACE",
    }
)
_PERMITTING_ACTIONS: Final[frozenset[str]] = frozenset({"SCMP_ACT_ALLOW", "SCMP_ACT_LOG"})
# Keys of a syscall entry we understand. ``includes``/``excludes`` (Moby's conditions on
# capabilities, architecture or kernel version) are refused: whether they apply depends
# on the container, which a pure evaluator cannot know, and guessing would be unsafe.
_RULE_KEYS: Final[frozenset[str]] = frozenset(
    {"names", "name", "action", "args", "errnoRet", "comment"}
)


@dataclass(frozen=True)
class SyscallCondition:
    """One ``args`` entry: compare syscall argument ``index`` with ``value`` using ``op``.

    For ``SCMP_CMP_MASKED_EQ`` the Docker format puts the mask in ``value`` and the
    expected result in ``value_two``: the condition holds when ``arg & value == value_two``.
    """

    index: int
    op: str
    value: int
    value_two: int = 0

    def holds(self, args: Sequence[int]) -> bool:
        """Whether the condition holds; missing arguments read as 0, values as unsigned 64-bit."""
        arg = (args[self.index] if self.index < len(args) else 0) & _U64
        match self.op:
            case "SCMP_CMP_EQ":
                return arg == self.value
            case "SCMP_CMP_NE":
                return arg != self.value
            case "SCMP_CMP_LT":
                return arg < self.value
            case "SCMP_CMP_LE":
                return arg <= self.value
            case "SCMP_CMP_GT":
                return arg > self.value
            case "SCMP_CMP_GE":
                return arg >= self.value
            case _:  # SCMP_CMP_MASKED_EQ; the parser admits nothing else
                return arg & self.value == self.value_two


@dataclass(frozen=True)
class SyscallRule:
    """One entry of the profile's ``syscalls`` list, validated."""

    position: int
    names: tuple[str, ...]
    action: str
    errno_ret: int | None
    conditions: tuple[SyscallCondition, ...]

    @property
    def conditions_are_alternatives(self) -> bool:
        """True when two conditions test the same argument.

        runc cannot hand libseccomp two comparisons of one argument in a single rule, so it
        adds each condition as a rule of its own: the conditions are then ORed, not ANDed.
        We copy that (surprising) behaviour so the model matches the loaded filter.
        """
        indices = [c.index for c in self.conditions]
        return len(indices) != len(set(indices))

    def matches(self, args: Sequence[int]) -> bool:
        """Whether this rule applies to a call with these arguments."""
        if not self.conditions:
            return True
        if self.conditions_are_alternatives:
            return any(c.holds(args) for c in self.conditions)
        return all(c.holds(args) for c in self.conditions)


@dataclass(frozen=True)
class SeccompVerdict:
    """What the profile does to one call: the action, its errno, and which rule decided."""

    action: str
    errno: int | None
    rule: int | None
    """Index into the profile's ``syscalls``; None when ``defaultAction`` decided."""

    @property
    def denied(self) -> bool:
        """True unless the call goes through (``SCMP_ACT_ALLOW`` or ``SCMP_ACT_LOG``)."""
        return self.action not in _PERMITTING_ACTIONS


@dataclass(frozen=True)
class ParsedProfile:
    """A validated profile: the default and the rules in file order."""

    default_action: str
    default_errno: int | None
    rules: tuple[SyscallRule, ...]


@functools.cache
def _profile_text() -> str:
    return PROFILE_PATH.read_text(encoding="utf-8")


def load_profile() -> dict[str, Any]:
    """Return kernelhub's profile as a fresh dict (the file is read once per process).

    A new dict on each call, so a caller that edits its copy cannot change what the
    next sandbox gets.
    """
    profile: dict[str, Any] = json.loads(_profile_text())
    return profile


@functools.cache
def profile_json() -> str:
    """The profile as compact JSON, for Docker's ``security_opt=["seccomp=<json>"]``.

    The daemon takes the profile's text, not a path (the CLI reads the file client-side),
    and a compact form keeps the container's inspect output short.
    """
    return json.dumps(load_profile(), separators=(",", ":"))


def parse_profile(profile: Mapping[str, Any]) -> ParsedProfile:
    """Validate a Docker-format profile into rules; raise ``SandboxError`` naming the entry.

    Refuses what it cannot model faithfully (``includes``/``excludes``, ``SCMP_ACT_NOTIFY``,
    unknown operators) rather than guessing: a misread profile is a silent hole.
    """
    default_action = _action(profile.get("defaultAction"), "defaultAction")
    default_errno = _errno(profile.get("defaultErrnoRet"), "defaultErrnoRet")
    entries = profile.get("syscalls") or []
    if not isinstance(entries, list):
        raise SandboxError(f"seccomp profile: 'syscalls' must be a list, not {entries!r}")
    rules = tuple(_rule(position, entry) for position, entry in enumerate(entries))
    return ParsedProfile(default_action, default_errno, rules)


def evaluate(
    profile: Mapping[str, Any] | ParsedProfile, syscall_name: str, args: Sequence[int] = ()
) -> SeccompVerdict:
    """Decide one call the way the loaded filter would.

    The first rule that names the syscall and whose conditions hold decides; with none,
    ``defaultAction`` does. "First" equals libseccomp's answer as long as all rules for
    one syscall share an action, which ``test_seccomp.py`` checks for our profile.
    Architecture is not modelled: the answer is the one for the native 64-bit ABI.
    """
    parsed = profile if isinstance(profile, ParsedProfile) else parse_profile(profile)
    for rule in parsed.rules:
        if syscall_name in rule.names and rule.matches(args):
            return SeccompVerdict(
                rule.action, _effective_errno(rule.action, rule.errno_ret), rule.position
            )
    return SeccompVerdict(
        parsed.default_action,
        _effective_errno(parsed.default_action, parsed.default_errno),
        None,
    )


def is_denied(
    profile: Mapping[str, Any] | ParsedProfile, syscall_name: str, args: tuple[int, ...] = ()
) -> bool:
    """Whether the profile stops ``syscall_name(*args)`` (errno, kill, trap or trace)."""
    return evaluate(profile, syscall_name, args).denied


def bpf_program(profile: Mapping[str, Any] | None = None) -> bytes:
    """Compile a profile (kernelhub's by default) to a classic-BPF seccomp program.

    Built for the native architecture only; calls from any other ABI (32-bit int 0x80,
    x32) kill the process, as nothing in the sandbox legitimately makes them. Names that
    this libseccomp does not know, or that do not exist on this architecture (``chown32``
    on x86_64), are skipped, as runc skips them. Raises ``BackendUnavailableError`` when
    libseccomp is missing and ``SandboxError`` when it rejects a rule.
    """
    seccomp = _import_pyseccomp()
    parsed = parse_profile(load_profile() if profile is None else profile)
    default = _pyseccomp_action(seccomp, parsed.default_action, parsed.default_errno)
    try:
        flt = seccomp.SyscallFilter(defaction=default)
        flt.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    except OSError as exc:
        raise SandboxError(f"libseccomp could not create a filter: {exc}") from exc
    with contextlib.suppress(OSError):
        # A binary search over syscall numbers instead of a linear scan; libseccomp < 2.5
        # lacks it, which costs speed, not safety.
        flt.set_attr(seccomp.Attr.CTL_OPTIMIZE, 2)
    for rule in parsed.rules:
        action = _pyseccomp_action(seccomp, rule.action, rule.errno_ret)
        if action == default:
            continue  # libseccomp refuses a rule that repeats the default; it changes nothing
        groups = _condition_groups(rule)
        for name in rule.names:
            number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
            if number < 0:  # unknown name, or a pseudo-number for another architecture
                continue
            for group in groups:
                arg_filters = [
                    seccomp.Arg(c.index, _PYSECCOMP_OPS[c.op], c.value, c.value_two) for c in group
                ]
                try:
                    flt.add_rule(action, number, *arg_filters)
                except OSError as exc:
                    raise SandboxError(
                        f"libseccomp rejected seccomp profile rule #{rule.position} for "
                        f"{name}: {exc}"
                    ) from exc
    with tempfile.TemporaryFile() as out:
        try:
            flt.export_bpf(out)
        except OSError as exc:
            raise SandboxError(f"libseccomp could not export the BPF program: {exc}") from exc
        out.seek(0)
        return out.read()


def compile_bpf(
    target: str | os.PathLike[str] | IO[bytes], profile: Mapping[str, Any] | None = None
) -> None:
    """Write ``bpf_program(profile)`` to a path or an open binary file, for ``bwrap --seccomp``.

    bwrap reads the program from a file descriptor, so the caller usually passes a
    temporary file (rewound before handing its fd over) or a path it then opens.
    """
    program = bpf_program(profile)
    if isinstance(target, str | os.PathLike):
        Path(target).write_bytes(program)
    else:
        target.write(program)
        target.flush()


# -- helpers -----------------------------------------------------------------------------

_PYSECCOMP_OPS: Final[dict[str, int]] = {
    # The numeric values of libseccomp's enum scmp_compare, which pyseccomp mirrors.
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}


def _import_pyseccomp() -> Any:
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as exc:  # RuntimeError: no libseccomp.so
        raise BackendUnavailableError(
            f"compiling the seccomp profile needs libseccomp and the pyseccomp package ({exc}); "
            "install libseccomp2 (Debian/Ubuntu) or libseccomp (Fedora)"
        ) from exc
    return pyseccomp


def _pyseccomp_action(seccomp: Any, action: str, errno_ret: int | None) -> int:
    match action:
        case "SCMP_ACT_ALLOW":
            value = seccomp.ALLOW
        case "SCMP_ACT_LOG":
            value = seccomp.LOG
        case "SCMP_ACT_ERRNO":
            value = seccomp.ERRNO(_effective_errno(action, errno_ret))
        case "SCMP_ACT_KILL" | "SCMP_ACT_KILL_THREAD":
            value = seccomp.KILL_THREAD
        case "SCMP_ACT_KILL_PROCESS":
            value = seccomp.KILL_PROCESS
        case "SCMP_ACT_TRAP":
            value = seccomp.TRAP
        case _:  # SCMP_ACT_TRACE; the parser admits nothing else
            value = seccomp.TRACE(_effective_errno(action, errno_ret))
    return int(value)


def _condition_groups(rule: SyscallRule) -> list[tuple[SyscallCondition, ...]]:
    """The libseccomp rules one entry becomes; see ``SyscallRule.conditions_are_alternatives``."""
    if rule.conditions_are_alternatives:
        return [(c,) for c in rule.conditions]
    return [rule.conditions]


def _effective_errno(action: str, errno_ret: int | None) -> int | None:
    if action not in ("SCMP_ACT_ERRNO", "SCMP_ACT_TRACE"):
        return None
    return errno.EPERM if errno_ret is None else errno_ret  # runc's default for both


def _action(value: object, where: str) -> str:
    if not isinstance(value, str) or value not in _ACTIONS:
        raise SandboxError(
            f"seccomp profile: {where} is {value!r}; expected one of {', '.join(sorted(_ACTIONS))}"
        )
    return value


def _errno(value: object, where: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 0xFFFF:
        raise SandboxError(f"seccomp profile: {where} is {value!r}; expected an errno like 1")
    return value


def _rule(position: int, entry: object) -> SyscallRule:
    where = f"syscalls[{position}]"
    if not isinstance(entry, Mapping):
        raise SandboxError(f"seccomp profile: {where} must be an object, not {entry!r}")
    unknown = set(entry) - _RULE_KEYS
    if unknown:
        raise SandboxError(
            f"seccomp profile: {where} has {', '.join(sorted(unknown))}, which kernelhub "
            "cannot model; write the rule for a container without capabilities instead"
        )
    names = list(entry.get("names") or [])
    if entry.get("name"):
        names.append(entry["name"])
    if not names or not all(isinstance(n, str) and n for n in names):
        raise SandboxError(f"seccomp profile: {where} needs 'names', a list of syscall names")
    conditions = tuple(
        _condition(f"{where}.args[{i}]", arg) for i, arg in enumerate(entry.get("args") or [])
    )
    if len(conditions) > _MAX_ARGS:
        raise SandboxError(f"seccomp profile: {where} has more than {_MAX_ARGS} conditions")
    return SyscallRule(
        position=position,
        names=tuple(names),
        action=_action(entry.get("action"), f"{where}.action"),
        errno_ret=_errno(entry.get("errnoRet"), f"{where}.errnoRet"),
        conditions=conditions,
    )


def _condition(where: str, arg: object) -> SyscallCondition:
    if not isinstance(arg, Mapping):
        raise SandboxError(f"seccomp profile: {where} must be an object, not {arg!r}")
    index, op = arg.get("index"), arg.get("op")
    value, value_two = arg.get("value", 0), arg.get("valueTwo", 0)
    if not isinstance(index, int) or not 0 <= index < _MAX_ARGS:
        raise SandboxError(f"seccomp profile: {where}.index is {index!r}; expected 0 to 5")
    if not isinstance(op, str) or op not in _OPS:
        raise SandboxError(
            f"seccomp profile: {where}.op is {op!r}; expected one of {', '.join(sorted(_OPS))}"
        )
    for key, number in (("value", value), ("valueTwo", value_two)):
        if not isinstance(number, int) or not 0 <= number <= _U64:
            raise SandboxError(
                f"seccomp profile: {where}.{key} is {number!r}; expected an unsigned 64-bit int"
            )
    return SyscallCondition(index=index, op=op, value=value, value_two=value_two)
