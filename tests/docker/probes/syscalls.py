"""Probe, from inside a sandbox, that the calls kernelhub's seccomp profile refuses stay refused.

Runs inside the container as the unprivileged kernel user: ``python3 syscalls.py``, or
``exec(open(path).read())`` in a kernel. Standard library only, never imports kernelhub.
Prints ONE JSON line mapping each probe to ``{"refused": bool, "errno": int | None}``:

* ``refused`` is true when the call failed with EPERM, EACCES or ENOSYS (what a seccomp
  filter or a missing capability answers) or the probe process was killed by SIGSYS (a
  filter's kill action, e.g. a syscall from an architecture the filter does not list);
* any other outcome, success (``errno`` None) or another errno such as EFAULT, EBADF or
  EAFNOSUPPORT, means the call reached the kernel code behind the permission checks.
  Where it is cheap, arguments are chosen to fail that way (NULL paths, fd -1), so an
  unfiltered call is told apart from a refused one without side effects.

``seccomp_mode_all_threads`` instead reports the ``Seccomp:`` mode (2 = filter) read from
``/proc/thread-self/status`` in the main thread and in a fresh thread.

x86_64 only: syscall numbers below are the x86_64 ones.
"""

import ctypes
import errno
import json
import mmap
import os
import platform
import signal
import socket
import struct
import threading

REFUSED_ERRNOS = {errno.EPERM, errno.EACCES, errno.ENOSYS}

# x86_64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl)
NR = {
    "clone": 56,
    "ptrace": 101,
    "personality": 135,
    "pivot_root": 155,
    "chroot": 161,
    "mount": 165,
    "umount2": 166,
    "init_module": 175,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "setns": 308,
    "process_vm_readv": 310,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
}

CLONE_NEWUSER = 0x10000000
SIGCHLD = 17
PTRACE_TRACEME = 0
KEYCTL_GET_KEYRING_ID = 0
KEY_SPEC_SESSION_KEYRING = -3
READ_IMPLIES_EXEC = 0x0400000
ADDR_NO_RANDOMIZE = 0x0040000
PER_QUERY = 0xFFFFFFFF
O_CLOEXEC = 0o2000000

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def outcome(ok, err=None, killed_by=None):
    """One probe's result in the shape the report promises."""
    if killed_by is not None:
        return {"refused": killed_by == signal.SIGSYS, "errno": None}
    if ok:
        return {"refused": False, "errno": None}
    return {"refused": err in REFUSED_ERRNOS, "errno": err}


def raw(name, *args):
    """Call syscall ``name`` with integer/pointer args; return (result, errno)."""
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(NR[name]), *(ctypes.c_long(a) for a in args))
    return result, (ctypes.get_errno() if result == -1 else None)


def syscall_probe(name, *args, close_fd=False):
    result, err = raw(name, *args)
    if result >= 0 and close_fd:
        os.close(result)
    return outcome(result >= 0, err)


def in_child(probe):
    """Run ``probe`` in a forked child, for calls that change the caller (namespaces,
    personality, tracing) or may get it killed (a filter's kill action)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.write(write_end, json.dumps(probe()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 4096):
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return outcome(False, killed_by=os.WTERMSIG(status))
    return json.loads(b"".join(chunks))


def socket_probe(family, type_, proto=0):
    try:
        socket.socket(family, type_, proto).close()
    except OSError as exc:
        return outcome(False, exc.errno)
    return outcome(True)


def io_uring_probe():
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    return syscall_probe("io_uring_setup", 1, ctypes.addressof(params), close_fd=True)


def process_vm_readv_probe():
    source = ctypes.create_string_buffer(b"probe", 8)
    target = ctypes.create_string_buffer(8)
    local = struct.pack("QQ", ctypes.addressof(target), 8)
    remote = struct.pack("QQ", ctypes.addressof(source), 8)
    local_iov = ctypes.create_string_buffer(local, len(local))
    remote_iov = ctypes.create_string_buffer(remote, len(remote))
    return syscall_probe(
        "process_vm_readv",
        os.getpid(),
        ctypes.addressof(local_iov),
        1,
        ctypes.addressof(remote_iov),
        1,
        0,
    )


def ptrace_traceme_probe():
    return in_child(lambda: syscall_probe("ptrace", PTRACE_TRACEME, 0, 0, 0))


def unshare_probe():
    return in_child(lambda: syscall_probe("unshare", CLONE_NEWUSER))


def clone_newuser_probe():
    def probe():
        result, err = raw("clone", CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
        if result == 0:  # the clone child: leave at once, it shares nothing we need
            os._exit(0)
        if result > 0:
            os.waitpid(result, 0)
        return outcome(result > 0, err)

    return in_child(probe)


def personality_probe(persona):
    def probe():
        result, err = raw("personality", persona)
        now, _ = raw("personality", PER_QUERY)
        # personality() returns the previous persona; success means the new bit is set.
        return outcome(result >= 0 and now >= 0 and now & persona == persona, err)

    return in_child(probe)


def i386_socketcall_vsock_probe():
    """socket(AF_VSOCK) through the 32-bit ABI's socketcall multiplexer (int 0x80).

    socketcall's arguments sit in memory, where seccomp cannot look, so a filter that lists
    the x86 sub-architecture and allows socketcall cannot enforce a socket family rule.
    """

    def probe():
        map_32bit = 0x40  # code and args must sit below 4 GiB: int 0x80 truncates to 32 bits
        page = mmap.mmap(
            -1,
            mmap.PAGESIZE,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_32bit,
            prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC,
        )
        base = ctypes.addressof(ctypes.c_char.from_buffer(page))
        args_at = base + 64
        code = (
            b"\x53"  # push rbx (callee-saved)
            + b"\xb8" + struct.pack("<I", 102)  # mov eax, __NR_socketcall (i386)
            + b"\xbb" + struct.pack("<I", 1)  # mov ebx, SYS_SOCKET
            + b"\xb9" + struct.pack("<I", args_at)  # mov ecx, &args
            + b"\xcd\x80"  # int 0x80
            + b"\x5b"  # pop rbx
            + b"\xc3"  # ret
        )  # fmt: skip
        page[: len(code)] = code
        page[64:76] = struct.pack("<iii", socket.AF_VSOCK, socket.SOCK_STREAM, 0)
        result = ctypes.CFUNCTYPE(ctypes.c_int)(base)()
        if result >= 0:
            os.close(result)
            return outcome(True)
        return outcome(False, -result)

    return in_child(probe)


def seccomp_modes():
    def mode():
        with open("/proc/thread-self/status") as status:
            for line in status:
                if line.startswith("Seccomp:"):
                    return int(line.split()[1])
        return None

    seen = {}
    worker = threading.Thread(target=lambda: seen.update(thread=mode()))
    worker.start()
    worker.join()
    return {"main": mode(), "thread": seen.get("thread")}


def main():
    if platform.machine() != "x86_64":
        print(json.dumps({"error": f"x86_64 only, not {platform.machine()}"}))
        return
    probes = {
        "io_uring_setup": io_uring_probe,
        "socket_af_vsock": lambda: socket_probe(40, socket.SOCK_STREAM),
        "socket_af_packet": lambda: socket_probe(17, socket.SOCK_RAW, socket.htons(3)),
        "socket_af_netlink_non_route": lambda: socket_probe(16, socket.SOCK_RAW, 9),
        "socket_af_alg": lambda: socket_probe(38, socket.SOCK_SEQPACKET),
        "socket_raw_inet": lambda: socket_probe(2, socket.SOCK_RAW, socket.IPPROTO_ICMP),
        "socket_af_vsock_via_i386_socketcall": i386_socketcall_vsock_probe,
        "keyctl": lambda: syscall_probe(
            "keyctl", KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0
        ),
        "add_key": lambda: syscall_probe("add_key", 0, 0, 0, 0, 0),  # NULL type: EFAULT
        "request_key": lambda: syscall_probe("request_key", 0, 0, 0, 0),  # NULL type: EFAULT
        "userfaultfd": lambda: syscall_probe("userfaultfd", O_CLOEXEC, close_fd=True),
        "perf_event_open": lambda: syscall_probe("perf_event_open", 0, 0, -1, -1, 0),
        "bpf": lambda: syscall_probe("bpf", 0, 0, 0),
        "ptrace_traceme": ptrace_traceme_probe,
        "process_vm_readv": process_vm_readv_probe,
        "mount": lambda: syscall_probe("mount", 0, 0, 0, 0, 0),  # NULL target: EFAULT
        "umount2": lambda: syscall_probe("umount2", 0, 0),  # NULL target: EFAULT
        "pivot_root": lambda: syscall_probe("pivot_root", 0, 0),
        "chroot": lambda: syscall_probe("chroot", 0),  # NULL path: EFAULT
        "unshare_newuser": unshare_probe,
        "setns": lambda: syscall_probe("setns", -1, 0),  # bad fd: EBADF
        "clone_newuser": clone_newuser_probe,
        "init_module": lambda: syscall_probe("init_module", 0, 0, 0),
        "kexec_load": lambda: syscall_probe("kexec_load", 0, 0, 0, 0),
        "personality_read_implies_exec": lambda: personality_probe(READ_IMPLIES_EXEC),
        "personality_addr_no_randomize": lambda: personality_probe(ADDR_NO_RANDOMIZE),
    }
    report = {name: probe() for name, probe in probes.items()}
    report["seccomp_mode_all_threads"] = seccomp_modes()
    print(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    main()
