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
)

#: Refused with ENOSYS, not EPERM: clone3 passes its flags in a struct that BPF cannot
#: read, and glibc falls back to plain clone() (whose flags the filter does check)
#: only on ENOSYS. With EPERM, every pthread_create in the guest would fail.
ENOSYS_SYSCALLS = ("clone3",)

#: Every socket family but AF_UNIX is refused: no IP of any version, no netlink
#: (route tables, audit), no raw packets, no vsock, no Bluetooth.
ALLOWED_SOCKET_FAMILY = socket.AF_UNIX

#: With ``loopback_tcp``, stream sockets of these families are allowed as well.
INET_FAMILIES = (socket.AF_INET, socket.AF_INET6)
#: Socket types refused for IP families even then (the low bits of socket()'s type).
_NON_STREAM_TYPES = (2, 3, 4, 5, 6, 10)  # DGRAM, RAW, RDM, SEQPACKET, DCCP, PACKET
_TYPE_MASK = 0xF
_DGRAM = 2


def _refused_types(allow_inet_dgram: bool) -> tuple[int, ...]:
    """With a run network (:mod:`._network`), UDP too: DNS is answered by the broker,
    any other datagram goes to it to be refused; raw and packet sockets never."""
    return tuple(t for t in _NON_STREAM_TYPES if not (allow_inet_dgram and t == _DGRAM))


def _refused_families(allow_inet_stream: bool) -> list[tuple[str, int]]:
    """(op, value) pairs, each one rule on socket()'s family: any match is refused.

    One comparison per rule because libseccomp takes one comparison per argument
    per rule; rules of one syscall are ORed.
    """
    allowed = {ALLOWED_SOCKET_FAMILY, *(INET_FAMILIES if allow_inet_stream else ())}
    if not allow_inet_stream:
        return [("NE", ALLOWED_SOCKET_FAMILY)]
    top = max(allowed)
    rules = [("LT", min(allowed)), ("GT", top)]
    rules += [("EQ", f) for f in range(min(allowed), top) if f not in allowed]
    return rules


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
_SCMP_CMP_LT = 2
_SCMP_CMP_EQ = 4
_SCMP_CMP_GT = 6
_SCMP_CMP_MASKED_EQ = 7
_OPS = {"NE": _SCMP_CMP_NE, "LT": _SCMP_CMP_LT, "EQ": _SCMP_CMP_EQ, "GT": _SCMP_CMP_GT}


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


def compile_bpf(allow_inet_stream: bool = False, allow_inet_dgram: bool = False) -> bytes:
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
        for name in ENOSYS_SYSCALLS:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr >= 0:
                _check(
                    lib.seccomp_rule_add_array(ctx, _act_errno(errno.ENOSYS), nr, 0, None),
                    f"deny {name}",
                )
        nr = lib.seccomp_syscall_resolve_name(b"socket")
        refuse = _act_errno(errno.EAFNOSUPPORT)
        for op, value in _refused_families(allow_inet_stream):
            cmp = (_ArgCmp * 1)(_ArgCmp(0, _OPS[op], value, 0))
            _check(lib.seccomp_rule_add_array(ctx, refuse, nr, 1, cmp), "restrict socket()")
        if allow_inet_stream:
            for family in INET_FAMILIES:
                for kind in _refused_types(allow_inet_dgram):
                    cmps = (_ArgCmp * 2)(
                        _ArgCmp(0, _SCMP_CMP_EQ, family, 0),
                        _ArgCmp(1, _SCMP_CMP_MASKED_EQ, _TYPE_MASK, kind),
                    )
                    _check(
                        lib.seccomp_rule_add_array(ctx, refuse, nr, 2, cmps),
                        "restrict socket() types",
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


def oci_seccomp(
    allow_inet_stream: bool = False, allow_inet_dgram: bool = False
) -> dict[str, object]:
    """The same filter in the OCI runtime-spec form, which ``runsc --oci-seccomp`` applies
    inside gVisor's own kernel (defence in depth: those calls never reach the host anyway)."""
    syscalls: list[dict[str, object]] = [
        # No clone3 rule here: this runsc ignores errnoRet and answers EPERM, which
        # breaks every pthread_create; clone3 inside the sentry creates only the
        # sentry's own virtual tasks and namespaces, never host ones.
        {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
    ]
    for op, value in _refused_families(allow_inet_stream):
        syscalls.append(
            {
                "names": ["socket"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": errno.EAFNOSUPPORT,
                "args": [{"index": 0, "value": value, "op": f"SCMP_CMP_{op}"}],
            }
        )
    if allow_inet_stream:
        for family in INET_FAMILIES:
            for kind in _refused_types(allow_inet_dgram):
                syscalls.append(
                    {
                        "names": ["socket"],
                        "action": "SCMP_ACT_ERRNO",
                        "errnoRet": errno.EAFNOSUPPORT,
                        "args": [
                            {"index": 0, "value": family, "op": "SCMP_CMP_EQ"},
                            {
                                "index": 1,
                                "value": _TYPE_MASK,
                                "valueTwo": kind,
                                "op": "SCMP_CMP_MASKED_EQ",
                            },
                        ],
                    }
                )
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
