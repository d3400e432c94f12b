"""The syscall filter of the bubblewrap driver (compiled BPF) and its gVisor twin (OCI JSON).

Built with the installed libseccomp through ctypes, so no compiler and no extra
Python package is needed. The filter allows by default and refuses, with EPERM,
the calls a confined program has no business making: they either reach kernel
attack surface (bpf, perf_event_open, io_uring, keyrings, user namespaces) or
are ways out of the sandbox (ptrace, mount, setns, network sockets).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import socket
from typing import Any

from proctor.sandbox._errors import SandboxUnavailable

#: Denied outright. io_uring is here because its opcodes (socket, connect, openat)
#: would bypass every rule below; clone3 because its flags sit behind a pointer
#: the filter cannot read, so callers fall back to clone(), whose flags it can.
DENIED_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "name_to_handle_at",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "quotactl",
    "syslog",
    "iopl",
    "ioperm",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "uselib",
    "vhangup",
    "lookup_dcookie",
    "clone3",
)

#: Every socket family but AF_UNIX is refused: no IP of any version, no netlink
#: (route tables, audit), no raw packets, no vsock, no Bluetooth.
ALLOWED_SOCKET_FAMILY = socket.AF_UNIX

#: Namespace flags a plain clone() may not carry.
CLONE_NAMESPACE_FLAGS = (
    0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
    | 0x00000080  # CLONE_NEWTIME
)

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_NE = 1
_SCMP_CMP_MASKED_EQ = 7


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


@functools.cache
def _libseccomp() -> Any:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SandboxUnavailable(
            "libseccomp is not installed, so no syscall filter can be built",
            hint="apt-get install libseccomp2",
        ) from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = (ctypes.c_uint32,)
    lib.seccomp_release.argtypes = (ctypes.c_void_p,)
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    )
    lib.seccomp_export_bpf.argtypes = (ctypes.c_void_p, ctypes.c_int)
    return lib


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise SandboxUnavailable(f"libseccomp failed to {what}: {os.strerror(-rc)}")


def compile_bpf() -> bytes:
    """The filter as a classic BPF program, the format ``bwrap --seccomp FD`` reads."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SandboxUnavailable("libseccomp could not create a filter context")
    try:
        deny = _act_errno(errno.EPERM)
        for name in DENIED_SYSCALLS:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue  # not a syscall on this architecture
            _check(lib.seccomp_rule_add_array(ctx, deny, nr, 0, None), f"deny {name}")
        nr = lib.seccomp_syscall_resolve_name(b"socket")
        cmp = (_ArgCmp * 1)(_ArgCmp(0, _SCMP_CMP_NE, ALLOWED_SOCKET_FAMILY, 0))
        _check(
            lib.seccomp_rule_add_array(ctx, _act_errno(errno.EAFNOSUPPORT), nr, 1, cmp),
            "restrict socket()",
        )
        nr = lib.seccomp_syscall_resolve_name(b"clone")
        # clone(flags, ...) on x86-64 and arm64 alike takes the flags first.
        # One rule per flag: MASKED_EQ matches when (flags & bit) == bit, and
        # libseccomp ORs the rules of one syscall together.
        for bit in range(64):
            flag = 1 << bit
            if CLONE_NAMESPACE_FLAGS & flag:
                cmp = (_ArgCmp * 1)(_ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
                _check(lib.seccomp_rule_add_array(ctx, deny, nr, 1, cmp), "restrict clone()")
        read_fd, write_fd = os.pipe()
        try:
            _check(lib.seccomp_export_bpf(ctx, write_fd), "export the filter")
            os.close(write_fd)
            write_fd = -1
            chunks = []
            while chunk := os.read(read_fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
    finally:
        lib.seccomp_release(ctx)


def oci_seccomp() -> dict[str, object]:
    """The same filter in the OCI runtime-spec form, which ``runsc --oci-seccomp`` applies
    inside gVisor's own kernel (defence in depth: those calls never reach the host anyway)."""
    syscalls: list[dict[str, object]] = [
        {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
        {
            "names": ["socket"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": errno.EAFNOSUPPORT,
            "args": [{"index": 0, "value": ALLOWED_SOCKET_FAMILY, "op": "SCMP_CMP_NE"}],
        },
    ]
    for bit in range(64):
        flag = 1 << bit
        if CLONE_NAMESPACE_FLAGS & flag:
            syscalls.append(
                {
                    "names": ["clone"],
                    "action": "SCMP_ACT_ERRNO",
                    "errnoRet": errno.EPERM,
                    "args": [
                        {"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}
                    ],
                }
            )
    return {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": syscalls}
