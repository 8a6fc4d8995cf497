"""kernelhub's seccomp profile, stated as data: what it refuses, what it must keep working.

The policy is checked through ``evaluate``/``is_denied`` (the pure model of how runc
applies the file); one test loads the compiled BPF into a child process so the model and
the real filter are held to the same answers. The Docker tier
(``tests/docker/probes/syscalls.py``) repeats the refusals inside a real sandbox.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import platform
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from kernelhub.errors import SandboxError
from kernelhub.sandbox.seccomp import (
    SECCOMP_PROFILE_VERSION,
    bpf_program,
    compile_bpf,
    evaluate,
    is_denied,
    load_profile,
    parse_profile,
    profile_json,
)

# Fingerprint of seccomp.json (canonical JSON) for each released profile version. Editing
# the file without bumping SECCOMP_PROFILE_VERSION fails here: sandboxes are labelled with
# the version, so two different rule sets must never share one.
PROFILE_FINGERPRINTS = {
    1: "5010569f2095ca392bab2e7972a980fcf1038d7c87278ed19eb20e5d3a306fee",
}

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET, SOCK_PACKET = 1, 2, 3, 5, 10
SOCK_NONBLOCK, SOCK_CLOEXEC = 0o4000, 0o2000000
SIGCHLD = 17
CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
# What glibc 2.36 passes: pthread_create, fork(), posix_spawn (subprocess, os.system).
CLONE_THREAD_FLAGS = 0x003D0F00
CLONE_FORK_FLAGS = 0x01200000 | SIGCHLD
CLONE_VFORK_FLAGS = 0x00004100 | SIGCHLD


@pytest.fixture(scope="module")
def profile() -> dict[str, Any]:
    return load_profile()


def test_profile_is_a_docker_profile_that_defaults_to_eperm(profile: dict[str, Any]) -> None:
    known_keys = {"defaultAction", "defaultErrnoRet", "archMap", "syscalls"}
    assert set(profile) == known_keys, "Docker ignores unknown keys; a typo would be silent"
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert profile["defaultErrnoRet"] == errno.EPERM
    assert evaluate(profile, "no_such_syscall").errno == errno.EPERM
    parse_profile(profile)  # every rule is one the model (and runc) understands


def test_only_64_bit_abis_are_listed(profile: dict[str, Any]) -> None:
    # A 32-bit sub-architecture would bring socketcall, whose arguments seccomp cannot see.
    arches = {a["architecture"]: a["subArchitectures"] for a in profile["archMap"]}
    assert arches == {"SCMP_ARCH_X86_64": [], "SCMP_ARCH_AARCH64": []}


def test_profile_change_comes_with_a_version_bump(profile: dict[str, Any]) -> None:
    canonical = json.dumps(profile, sort_keys=True, separators=(",", ":")).encode()
    fingerprint = hashlib.sha256(canonical).hexdigest()
    assert PROFILE_FINGERPRINTS.get(SECCOMP_PROFILE_VERSION) == fingerprint, (
        "seccomp.json changed: bump SECCOMP_PROFILE_VERSION and add "
        f"{SECCOMP_PROFILE_VERSION + 1}: {fingerprint!r} to PROFILE_FINGERPRINTS"
    )


def test_profile_json_is_compact_and_equal_to_the_file(profile: dict[str, Any]) -> None:
    text = profile_json()
    assert "\n" not in text and '", "' not in text and '": ' not in text
    assert json.loads(text) == profile


def test_load_profile_hands_out_copies() -> None:
    first = load_profile()
    first["syscalls"].clear()
    assert load_profile()["syscalls"], "editing one copy must not change the next sandbox's"


def test_each_syscall_has_one_action(profile: dict[str, Any]) -> None:
    # The model takes the first matching rule; libseccomp ORs rules with one action. The
    # two agree only while no syscall has rules with different actions.
    actions: dict[str, set[tuple[str, int | None]]] = defaultdict(set)
    for rule in parse_profile(profile).rules:
        for name in rule.names:
            actions[name].add((rule.action, rule.errno_ret))
    assert {name: a for name, a in actions.items() if len(a) > 1} == {}


def test_no_rule_relies_on_runcs_or_of_same_argument_conditions(profile: dict[str, Any]) -> None:
    assert [r.position for r in parse_profile(profile).rules if r.conditions_are_alternatives] == []


REFUSED: list[tuple[str, tuple[int, ...]]] = [
    ("io_uring_setup", (1, 0)),
    ("io_uring_enter", (3, 1, 0, 0, 0, 0)),
    ("io_uring_register", (3, 0, 0, 0)),
    # socket families other than unix/inet/inet6, and netlink beyond NETLINK_ROUTE
    ("socket", (40, SOCK_STREAM, 0)),  # AF_VSOCK
    ("socket", (40, SOCK_STREAM | SOCK_CLOEXEC, 0)),
    ("socket", (17, SOCK_RAW, 0x0300)),  # AF_PACKET
    ("socket", (17, SOCK_DGRAM, 0x0300)),
    ("socket", (AF_NETLINK, SOCK_RAW, 9)),  # NETLINK_AUDIT
    ("socket", (AF_NETLINK, SOCK_RAW, 4)),  # NETLINK_SOCK_DIAG
    ("socket", (AF_NETLINK, SOCK_RAW, 15)),  # NETLINK_KOBJECT_UEVENT
    ("socket", (38, SOCK_SEQPACKET, 0)),  # AF_ALG
    ("socket", (31, SOCK_STREAM, 3)),  # AF_BLUETOOTH
    ("socket", (21, SOCK_DGRAM, 0)),  # AF_RDS
    ("socket", (30, SOCK_DGRAM, 0)),  # AF_TIPC
    ("socket", (0, SOCK_STREAM, 0)),  # AF_UNSPEC
    # raw and packet-type sockets, whatever the family
    ("socket", (AF_INET, SOCK_RAW, 1)),
    ("socket", (AF_INET, SOCK_RAW | SOCK_CLOEXEC, 255)),
    ("socket", (AF_INET6, SOCK_RAW, 58)),
    ("socket", (AF_INET, SOCK_PACKET, 0x0300)),
    ("socket", (AF_INET, 4, 0)),  # SOCK_RDM
    ("socket", (AF_UNIX, SOCK_RAW, 0)),
    ("socketpair", (AF_INET, SOCK_STREAM, 0)),
    ("socketpair", (40, SOCK_STREAM, 0)),
    ("keyctl", (0, 2**64 - 3, 0)),
    ("add_key", (0, 0, 0, 0, 0)),
    ("request_key", (0, 0, 0, 0)),
    ("userfaultfd", (0,)),
    ("perf_event_open", (0, 0, -1, -1, 0)),
    ("bpf", (0, 0, 0)),
    ("ptrace", (0, 0, 0, 0)),
    ("process_vm_readv", (1, 0, 1, 0, 1, 0)),
    ("process_vm_writev", (1, 0, 1, 0, 1, 0)),
    ("mount", (0, 0, 0, 0, 0)),
    ("umount", (0,)),
    ("umount2", (0, 0)),
    ("pivot_root", (0, 0)),
    ("chroot", (0,)),
    ("move_mount", (0, 0, 0, 0, 0)),
    ("open_tree", (0, 0, 0)),
    ("fsopen", (0, 0)),
    ("fsmount", (0, 0, 0)),
    ("fsconfig", (0, 0, 0, 0, 0)),
    ("fspick", (0, 0, 0)),
    ("mount_setattr", (0, 0, 0, 0, 0)),
    ("unshare", (0x10000000,)),
    ("unshare", (0,)),
    ("setns", (3, 0)),
    ("init_module", (0, 0, 0)),
    ("finit_module", (3, 0, 0)),
    ("delete_module", (0, 0)),
    ("kexec_load", (0, 0, 0, 0)),
    ("kexec_file_load", (3, 3, 0, 0, 0)),
    ("personality", (0x0400000,)),  # READ_IMPLIES_EXEC
    ("personality", (0x0040000,)),  # ADDR_NO_RANDOMIZE
    ("personality", (0x0008000 | 0x0040000,)),
    ("personality", (2**64 - 1,)),  # -1 sign-extended is not the 32-bit query value
    ("acct", (0,)),
    ("swapon", (0, 0)),
    ("swapoff", (0,)),
    ("reboot", (0, 0, 0, 0)),
    ("settimeofday", (0, 0)),
    ("stime", (0,)),
    ("clock_settime", (0, 0)),
    ("clock_adjtime", (0, 0)),
    ("adjtimex", (0,)),
    ("quotactl", (0, 0, 0, 0)),
    ("quotactl_fd", (3, 0, 0, 0)),
    ("lookup_dcookie", (0, 0, 0)),
    ("name_to_handle_at", (3, 0, 0, 0, 0)),
    ("open_by_handle_at", (3, 0, 0)),
    ("iopl", (3,)),
    ("ioperm", (0, 1, 1)),
    ("vhangup", ()),
    ("nfsservctl", (0, 0, 0)),
    ("syslog", (3, 0, 0)),
    ("sethostname", (0, 0)),
    ("setdomainname", (0, 0)),
    ("kcmp", (1, 2, 0, 0, 0)),
    ("pidfd_getfd", (3, 0, 0)),
    ("process_madvise", (3, 0, 1, 0, 0)),
    ("fanotify_init", (0, 0)),
    ("mbind", (0, 0, 0, 0, 0, 0)),
    ("set_mempolicy", (0, 0, 0)),
    ("socketcall", (1, 0)),
    ("uselib", (0,)),
    ("vm86", (0, 0)),
]


@pytest.mark.parametrize(("name", "args"), REFUSED, ids=[f"{n}{a}" for n, a in REFUSED])
def test_refused(profile: dict[str, Any], name: str, args: tuple[int, ...]) -> None:
    assert is_denied(profile, name, args)


@pytest.mark.parametrize("flag", sorted(CLONE_NEW))
@pytest.mark.parametrize("base", [SIGCHLD, CLONE_FORK_FLAGS, CLONE_THREAD_FLAGS])
def test_clone_with_a_namespace_flag_is_refused(
    profile: dict[str, Any], base: int, flag: str
) -> None:
    assert is_denied(profile, "clone", (base | CLONE_NEW[flag], 0, 0, 0, 0))


def test_clone3_answers_enosys_so_glibc_falls_back_to_clone(profile: dict[str, Any]) -> None:
    # clone3 passes its flags in a struct in memory, out of seccomp's reach.
    verdict = evaluate(profile, "clone3", (0, 88))
    assert verdict.denied
    assert (verdict.action, verdict.errno) == ("SCMP_ACT_ERRNO", errno.ENOSYS)


ALLOWED: list[tuple[str, tuple[int, ...]]] = [
    ("read", (0, 0, 1)),
    ("write", (1, 0, 1)),
    ("mmap", (0, 4096, 3, 0x22, 2**64 - 1, 0)),
    ("mprotect", (0, 4096, 1)),
    ("munmap", (0, 4096)),
    ("brk", (0,)),
    ("madvise", (0, 4096, 4)),
    ("futex", (0, 128, 0, 0, 0, 0)),
    ("clone", (CLONE_THREAD_FLAGS, 0, 0, 0, 0)),
    ("clone", (CLONE_FORK_FLAGS, 0, 0, 0, 0)),
    ("clone", (CLONE_VFORK_FLAGS, 0, 0, 0, 0)),
    ("clone", (SIGCHLD,)),
    ("fork", ()),
    ("vfork", ()),
    ("execve", (0, 0, 0)),
    ("execveat", (3, 0, 0, 0, 0)),
    ("wait4", (2**64 - 1, 0, 0, 0)),
    ("waitid", (0, 0, 0, 4)),
    ("exit_group", (0,)),
    ("kill", (1, 15)),
    ("tgkill", (1, 1, 2)),
    ("socket", (AF_UNIX, SOCK_STREAM, 0)),
    ("socket", (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0)),
    ("socket", (AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0)),
    ("socket", (AF_UNIX, SOCK_SEQPACKET, 0)),
    ("socket", (AF_INET, SOCK_STREAM, 6)),
    ("socket", (AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 17)),
    ("socket", (AF_INET, SOCK_DGRAM, 1)),  # unprivileged ICMP "ping" socket
    ("socket", (AF_INET6, SOCK_STREAM | SOCK_NONBLOCK, 0)),
    ("socket", (AF_INET6, SOCK_DGRAM, 0)),
    ("socket", (AF_NETLINK, SOCK_RAW, 0)),  # glibc getaddrinfo (NETLINK_ROUTE)
    ("socket", (AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, 0)),
    ("socket", (AF_NETLINK, SOCK_DGRAM, 0)),
    ("socketpair", (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, 0)),
    ("socketpair", (AF_UNIX, SOCK_DGRAM, 0, 0)),
    ("bind", (3, 0, 110)),
    ("listen", (3, 128)),
    ("accept4", (3, 0, 0, 0x80000)),
    ("connect", (3, 0, 110)),
    ("sendmsg", (3, 0, 0)),
    ("recvmsg", (3, 0, 0)),
    ("sendto", (3, 0, 1, 0, 0, 0)),
    ("recvfrom", (3, 0, 1, 0, 0, 0)),
    ("getsockopt", (3, 1, 4, 0, 0)),
    ("setsockopt", (3, 1, 2, 0, 4)),
    ("shutdown", (3, 2)),
    ("epoll_create1", (0x80000,)),
    ("epoll_ctl", (3, 1, 4, 0)),
    ("epoll_wait", (3, 0, 1, 0)),
    ("epoll_pwait", (3, 0, 1, 0, 0, 8)),
    ("poll", (0, 1, 0)),
    ("ppoll", (0, 1, 0, 0, 8)),
    ("select", (1, 0, 0, 0, 0)),
    ("eventfd2", (0, 0x80000)),
    ("pipe2", (0, 0x80000)),
    ("openat", (2**64 - 100, 0, 0x80000)),
    ("close", (3,)),
    ("close_range", (3, 2**32 - 1, 0)),
    ("newfstatat", (3, 0, 0, 0x1000)),
    ("statx", (3, 0, 0, 0, 0)),
    ("getdents64", (3, 0, 4096)),
    ("lseek", (3, 0, 0)),
    ("fcntl", (3, 1, 0)),
    ("ioctl", (1, 0x5401, 0)),
    ("dup3", (3, 4, 0x80000)),
    ("unlink", (0,)),
    ("rename", (0, 0)),
    ("mkdir", (0, 0o755)),
    ("ftruncate", (3, 0)),
    ("fsync", (3,)),
    ("memfd_create", (0, 1)),
    ("getrandom", (0, 16, 0)),
    ("rseq", (0, 32, 0, 0)),
    ("set_robust_list", (0, 24)),
    ("set_tid_address", (0,)),
    ("arch_prctl", (0x1002, 0)),
    ("prctl", (15, 0)),
    ("prlimit64", (0, 7, 0, 0)),
    ("sched_getaffinity", (0, 128, 0)),
    ("sched_yield", ()),
    ("rt_sigaction", (2, 0, 0, 8)),
    ("rt_sigprocmask", (0, 0, 0, 8)),
    ("rt_sigreturn", ()),
    ("sigaltstack", (0, 0)),
    ("nanosleep", (0, 0)),
    ("clock_gettime", (1, 0)),
    ("clock_nanosleep", (1, 0, 0, 0)),
    ("getpid", ()),
    ("gettid", ()),
    ("getuid", ()),
    ("uname", (0,)),
    ("sysinfo", (0,)),
    ("getcwd", (0, 4096)),
    ("umask", (0o22,)),
    ("shmget", (0, 4096, 0o1600)),
    ("semget", (0, 1, 0o1600)),
    ("semop", (0, 0, 1)),
    ("mq_open", (0, 0, 0, 0)),
    ("personality", (0xFFFFFFFF,)),  # query, as Python's platform module may do
    ("personality", (0,)),
    ("personality", (0x8,)),
    ("personality", (0x20000,)),
    ("personality", (0x20008,)),
    ("seccomp", (1, 0, 0)),  # a stricter filter on top of ours is fine
    ("landlock_create_ruleset", (0, 0, 1)),
    ("pidfd_open", (1, 0)),
    ("membarrier", (0, 0)),
]


@pytest.mark.parametrize(("name", "args"), ALLOWED, ids=[f"{n}{a}" for n, a in ALLOWED])
def test_allowed(profile: dict[str, Any], name: str, args: tuple[int, ...]) -> None:
    assert not is_denied(profile, name, args)


# -- the model itself, on small hand-written profiles ------------------------------------


def one_rule(*conditions: dict[str, Any]) -> dict[str, Any]:
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "syscalls": [{"names": ["x"], "action": "SCMP_ACT_ALLOW", "args": list(conditions)}],
    }


@pytest.mark.parametrize(
    ("op", "value", "value_two", "arg", "allowed"),
    [
        ("SCMP_CMP_EQ", 5, 0, 5, True),
        ("SCMP_CMP_EQ", 5, 0, 6, False),
        ("SCMP_CMP_NE", 5, 0, 6, True),
        ("SCMP_CMP_NE", 5, 0, 5, False),
        ("SCMP_CMP_LT", 5, 0, 4, True),
        ("SCMP_CMP_LT", 5, 0, 5, False),
        ("SCMP_CMP_LE", 5, 0, 5, True),
        ("SCMP_CMP_LE", 5, 0, 6, False),
        ("SCMP_CMP_GT", 5, 0, 6, True),
        ("SCMP_CMP_GT", 5, 0, 5, False),
        ("SCMP_CMP_GE", 5, 0, 5, True),
        ("SCMP_CMP_GE", 5, 0, 4, False),
        ("SCMP_CMP_MASKED_EQ", 0xF, 2, 0x80802, True),
        ("SCMP_CMP_MASKED_EQ", 0xF, 2, 0x80803, False),
        ("SCMP_CMP_GT", 5, 0, -1, True),  # arguments compare as unsigned 64-bit
    ],
)
def test_each_operator(op: str, value: int, value_two: int, arg: int, allowed: bool) -> None:
    profile = one_rule({"index": 0, "op": op, "value": value, "valueTwo": value_two})
    assert is_denied(profile, "x", (arg,)) is not allowed


def test_conditions_on_different_arguments_are_anded() -> None:
    profile = one_rule(
        {"index": 0, "op": "SCMP_CMP_EQ", "value": 1},
        {"index": 2, "op": "SCMP_CMP_EQ", "value": 3},
    )
    assert not is_denied(profile, "x", (1, 0, 3))
    assert is_denied(profile, "x", (1, 0, 4))
    assert is_denied(profile, "x", (1,)), "missing arguments read as 0"


def test_conditions_on_one_argument_are_ored_as_runc_does() -> None:
    profile = one_rule(
        {"index": 0, "op": "SCMP_CMP_EQ", "value": 1},
        {"index": 0, "op": "SCMP_CMP_EQ", "value": 2},
    )
    assert not is_denied(profile, "x", (1,))
    assert not is_denied(profile, "x", (2,))
    assert is_denied(profile, "x", (3,))


def test_first_matching_rule_decides_and_is_reported() -> None:
    profile = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [
            {"names": ["a", "x"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
            {"names": ["x"], "action": "SCMP_ACT_KILL_PROCESS"},
        ],
    }
    verdict = evaluate(profile, "x")
    assert (verdict.action, verdict.errno, verdict.rule) == ("SCMP_ACT_ERRNO", 38, 0)
    assert evaluate(profile, "y").rule is None and not is_denied(profile, "y")


@pytest.mark.parametrize(
    ("entry", "complaint"),
    [
        ({"names": ["x"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
         "includes"),
        ({"names": ["x"], "action": "SCMP_ACT_NOTIFY"}, "SCMP_ACT_NOTIFY"),
        ({"names": [], "action": "SCMP_ACT_ALLOW"}, "names"),
        ({"names": ["x"], "action": "SCMP_ACT_ALLOW",
          "args": [{"index": 0, "op": "SCMP_CMP_BETWEEN", "value": 1}]}, "SCMP_CMP_BETWEEN"),
        ({"names": ["x"], "action": "SCMP_ACT_ALLOW",
          "args": [{"index": 6, "op": "SCMP_CMP_EQ", "value": 1}]}, "index"),
    ],
)  # fmt: skip
def test_rules_the_model_cannot_read_faithfully_are_refused(
    entry: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(SandboxError, match=complaint):
        parse_profile({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [entry]})


# -- the compiled filter -----------------------------------------------------------------


def test_compile_bpf_writes_a_program_to_a_path_or_a_file(tmp_path: Path) -> None:
    program = bpf_program()
    assert program and len(program) % 8 == 0, "a whole number of 8-byte sock_filter insns"
    compile_bpf(tmp_path / "a.bpf")
    with (tmp_path / "b.bpf").open("wb") as fh:
        compile_bpf(fh)
    buffer = io.BytesIO()
    compile_bpf(buffer)
    assert (tmp_path / "a.bpf").read_bytes() == (tmp_path / "b.bpf").read_bytes() == program
    assert buffer.getvalue() == program


def test_compile_bpf_skips_names_this_libseccomp_does_not_know() -> None:
    profile = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "syscalls": [{"names": ["read", "no_such_call", "chown32"], "action": "SCMP_ACT_ALLOW"}],
    }
    assert bpf_program(profile)


# Runs in a fresh interpreter: load the program with prctl, then try calls both ways.
ENFORCEMENT_CHILD = r"""
import ctypes, errno, json, socket, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
program = open(sys.argv[1], "rb").read()
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
assert libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
fprog = Fprog(len(program) // 8, program)
loaded = libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)
assert loaded == 0, ctypes.get_errno()

def raw(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    return ctypes.get_errno() if r == -1 else 0

def sock(*args):
    try:
        socket.socket(*args).close()
        return 0
    except OSError as exc:
        return exc.errno

seen = []
t = threading.Thread(target=seen.append, args=(1,)); t.start(); t.join()
a, b = socket.socketpair(); a.close(); b.close()
print(json.dumps({
    "thread": seen == [1],
    "subprocess": subprocess.run(["true"]).returncode,
    "af_unix": sock(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC),
    "af_inet": sock(socket.AF_INET, socket.SOCK_DGRAM),
    "af_vsock": sock(40, socket.SOCK_STREAM),
    "raw_inet": sock(socket.AF_INET, socket.SOCK_RAW, 1),
    "netlink_audit": sock(16, socket.SOCK_RAW, 9),
    "io_uring_setup": raw(425, 1, 0),
    "clone3": raw(435, 0, 0),
    "unshare": raw(272, 0x10000000),
    "keyctl": raw(250, 0, 0, 0),
}))
"""


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the child uses x86_64 syscall numbers and Linux prctl",
)
def test_compiled_filter_enforces_what_the_model_says(tmp_path: Path) -> None:
    compile_bpf(tmp_path / "filter.bpf")
    script = tmp_path / "child.py"
    script.write_text(ENFORCEMENT_CHILD)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "filter.bpf")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {
        "thread": True,
        "subprocess": 0,
        "af_unix": 0,
        "af_inet": 0,
        "af_vsock": errno.EPERM,
        "raw_inet": errno.EPERM,
        "netlink_audit": errno.EPERM,
        "io_uring_setup": errno.EPERM,
        "clone3": errno.ENOSYS,
        "unshare": errno.EPERM,
        "keyctl": errno.EPERM,
    }
