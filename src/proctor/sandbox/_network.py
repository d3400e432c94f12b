"""A run's network: every TCP connection and UDP datagram the guest sends reaches
the host side of one veth pair, and nothing else exists.

Two network namespaces per run, made by the host (root) and held only by file
descriptors, so they vanish with the last holder (no name under /run/netns to
leak): the guest's, with loopback and one end of a veth pair (``g0``,
169.254.77.2/30, default route through the other end), and the relay's, with
the other end (``r0``, 169.254.77.1) and nftables rules that hand every TCP
connection arriving on ``r0`` to one listener (``REDIRECT``; the original
destination is read back with ``SO_ORIGINAL_DST``) and every UDP datagram to
one socket (``TPROXY``; the original destination comes with each datagram).
The relay namespace has no other interface and forwards nothing: a packet
that is not for those two sockets goes nowhere. The sockets are made here, in
the relay namespace, and handed to the broker (:mod:`proctor.broker`), which
answers DNS and decides each connection.

Both backends use the same pair. bubblewrap's guest runs in the guest namespace
itself (a namespace of the host's user namespace: the guest holds no
capability there and cannot change an address, a route or a rule). gVisor
takes ``g0`` into its own network stack (``--network=sandbox``), so the
guest's packets are made by gVisor, not the host kernel.

Linux 6.x made ``net.core.rmem_default`` visible in every network namespace,
and the runsc Debian ships (2022-12-19) reads its presence as "this is the
host's namespace" and refuses sandbox networking. runsc is therefore started
in a mount namespace of its own with an empty, read-only ``/proc/sys/net``
(:func:`runsc_prefix`); nothing else runsc does reads it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

from proctor.sandbox._errors import SandboxUnavailable

#: The relay's end of the pair: the guest's gateway and its DNS server.
RELAY_ADDRESS: Final = "169.254.77.1"
#: The guest's end.
GUEST_ADDRESS: Final = "169.254.77.2"
GUEST_IFACE: Final = "g0"
RELAY_IFACE: Final = "r0"
#: Where the relay namespace's rules send every TCP connection and UDP datagram.
TCP_PORT: Final = 15001
UDP_PORT: Final = 15053
#: Policy routing mark for TPROXY'd datagrams (local delivery of any address).
_MARK: Final = 1
_TABLE: Final = 100
#: The guest's /etc/resolv.conf (the relay answers; one try) and /etc/hosts: the
#: same for every run, so shipped with the package, never written per run (a
#: file per run would outlive an owner killed with SIGKILL).
NET_FILES: Final = Path(__file__).resolve().parent / "netfiles"

_RULES: Final = f"""
table ip proctor {{
  chain divert {{
    type filter hook prerouting priority mangle; policy accept;
    iifname "{RELAY_IFACE}" meta l4proto udp tproxy to :{UDP_PORT} meta mark set {_MARK} accept
  }}
  chain capture {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{RELAY_IFACE}" meta l4proto tcp redirect to :{TCP_PORT}
  }}
}}
"""

_T = TypeVar("_T")
_CLONE_NEWNET: Final = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _unshare_net() -> None:
    # os.unshare and os.setns arrive with Python 3.12; the project supports 3.11.
    if _libc.unshare(_CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


_SO_ORIGINAL_DST: Final = 80
_IP_TRANSPARENT: Final = 19
_IP_RECVORIGDSTADDR: Final = 20


def _tools() -> tuple[str, str, str]:
    found = tuple(
        shutil.which(t, path="/usr/sbin:/usr/bin:/sbin:/bin") for t in ("ip", "nft", "nsenter")
    )
    missing = [
        t
        for t, p in zip(
            ("ip (iproute2)", "nft (nftables)", "nsenter (util-linux)"), found, strict=True
        )
        if p is None
    ]
    if missing:
        raise SandboxUnavailable(f"a run's network needs {', '.join(missing)}: install them")
    ip, nft, nsenter = found
    assert ip is not None and nft is not None and nsenter is not None
    return ip, nft, nsenter


def available() -> bool:
    """Whether this host can give runs a network (the tools, and root)."""
    try:
        _tools()
    except SandboxUnavailable:
        return False
    return os.geteuid() == 0


def _in_thread(fn: Callable[[], _T]) -> _T:
    """Run ``fn`` in a thread of its own: a namespace joined or made there is that
    thread's alone, and it ends with the thread."""
    out: list[_T] = []
    err: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            err.append(exc)

    t = threading.Thread(target=target, name="proctor-netns")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def _new_netns() -> int:
    def make() -> int:
        _unshare_net()
        return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    try:
        return _in_thread(make)
    except OSError as exc:
        raise SandboxUnavailable(f"cannot make a network namespace: {exc.strerror}") from exc


class GuestNetwork:
    """One run's pair of network namespaces (see the module's docstring).

    Made by :meth:`create`, closed by :meth:`close` (the namespaces go when the
    sandbox that joined one has exited too). ``files`` are the guest's
    ``/etc/resolv.conf`` and ``/etc/hosts`` (host path -> guest path).
    """

    #: The relay's own address (a connection to it is to nothing the guest may use).
    relay_address: Final = RELAY_ADDRESS

    @staticmethod
    def original_destination(conn: socket.socket) -> tuple[str, int]:
        return original_destination(conn)

    @staticmethod
    def datagram_destination(ancillary: list[tuple[int, int, bytes]]) -> tuple[str, int] | None:
        return datagram_destination(ancillary)

    def __init__(self, guest_ns: int, relay_ns: int) -> None:
        self.guest_ns = guest_ns
        self.relay_ns = relay_ns
        self.files: dict[Path, str] = {
            NET_FILES / "resolv.conf": "/etc/resolv.conf",
            NET_FILES / "hosts": "/etc/hosts",
        }
        self._closed = False

    @classmethod
    def create(cls) -> GuestNetwork:
        ip, nft, nsenter = _tools()
        guest_ns = _new_netns()
        try:
            relay_ns = _new_netns()
        except BaseException:
            os.close(guest_ns)
            raise
        net = cls(guest_ns, relay_ns)
        try:
            guest, relay = net.path(guest_ns), net.path(relay_ns)
            _run([nsenter, f"--net={relay}", ip, "link", "set", "lo", "up"], (relay_ns,))
            _run([nsenter, f"--net={guest}", ip, "-batch", "-"], (guest_ns, relay_ns), (
                "link set lo up\n"
                f"link add {GUEST_IFACE} type veth peer name {RELAY_IFACE} netns {relay}\n"
                f"addr add {GUEST_ADDRESS}/30 dev {GUEST_IFACE}\n"
                f"link set {GUEST_IFACE} up\n"
                f"route add default via {RELAY_ADDRESS} dev {GUEST_IFACE}\n"
            ))  # fmt: skip
            _run([nsenter, f"--net={relay}", ip, "-batch", "-"], (relay_ns,), (
                f"addr add {RELAY_ADDRESS}/30 dev {RELAY_IFACE}\n"
                f"link set {RELAY_IFACE} up\n"
                f"rule add fwmark {_MARK} lookup {_TABLE}\n"
                f"route add local 0.0.0.0/0 dev lo table {_TABLE}\n"
            ))  # fmt: skip
            _run([nsenter, f"--net={relay}", nft, "-f", "-"], (relay_ns,), _RULES)
        except BaseException:
            net.close()
            raise
        return net

    @staticmethod
    def path(fd: int) -> str:
        """A path naming the namespace ``fd`` holds, for tools run as root here."""
        return f"/proc/{os.getpid()}/fd/{fd}"

    def guest_path(self) -> str:
        return self.path(self.guest_ns)

    def relay_sockets(self) -> tuple[socket.socket, socket.socket]:
        """The relay's TCP listener and UDP socket, made in the relay namespace."""

        def make() -> tuple[socket.socket, socket.socket]:
            _setns(self.relay_ns)
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind(("0.0.0.0", TCP_PORT))  # noqa: S104 - the relay namespace's own
                tcp.listen(128)
                udp.setsockopt(socket.SOL_IP, _IP_TRANSPARENT, 1)
                udp.setsockopt(socket.SOL_IP, _IP_RECVORIGDSTADDR, 1)
                udp.bind(("0.0.0.0", UDP_PORT))  # noqa: S104
            except BaseException:
                tcp.close()
                udp.close()
                raise
            return tcp, udp

        return _in_thread(make)

    def reply_socket(self, source: tuple[str, int]) -> socket.socket:
        """A UDP socket in the relay namespace sending from ``source`` (a datagram's
        original destination), so the guest's resolver takes the answer."""

        def make() -> socket.socket:
            _setns(self.relay_ns)
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                s.setsockopt(socket.SOL_IP, _IP_TRANSPARENT, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(source)
            except BaseException:
                s.close()
                raise
            return s

        return _in_thread(make)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (self.guest_ns, self.relay_ns):
            with contextlib.suppress(OSError):
                os.close(fd)


def original_destination(conn: socket.socket) -> tuple[str, int]:
    """Where a redirected TCP connection was going (``SO_ORIGINAL_DST``)."""
    raw = conn.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port = int.from_bytes(raw[2:4], "big")
    return str(ipaddress.IPv4Address(raw[4:8])), port


def datagram_destination(ancillary: list[tuple[int, int, bytes]]) -> tuple[str, int] | None:
    """A TPROXY'd datagram's original destination, from ``recvmsg``'s ancillary data."""
    for level, kind, data in ancillary:
        if level == socket.SOL_IP and kind == _IP_RECVORIGDSTADDR and len(data) >= 8:
            return str(ipaddress.IPv4Address(data[4:8])), int.from_bytes(data[2:4], "big")
    return None


def network_prefix(network: GuestNetwork) -> list[str]:
    """What starts a program (bwrap) in the run's guest namespace."""
    nsenter = _tools()[2]
    return [nsenter, f"--net={network.guest_path()}", "--"]


def runsc_prefix() -> list[str]:
    """What starts runsc in a mount namespace with ``/proc/sys/net`` hidden (see the
    module's docstring)."""
    unshare = shutil.which("unshare", path="/usr/bin:/bin")
    if unshare is None:
        raise SandboxUnavailable("a gVisor run's network needs unshare (util-linux)")
    return [
        unshare, "--mount", "--propagation", "private", "--",
        "/bin/sh", "-c", 'mount -t tmpfs -o ro,size=4k proctor-net /proc/sys/net && exec "$@"',
        "proctor-runsc",
    ]  # fmt: skip


def _run(argv: list[str], fds: tuple[int, ...], stdin: str | None = None) -> None:
    try:
        done = subprocess.run(
            argv, input=stdin.encode() if stdin is not None else None, capture_output=True,
            pass_fds=fds, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"cannot set up a run's network: {exc}") from exc
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        tool = Path(argv[2]).name
        raise SandboxUnavailable(
            f"cannot set up a run's network ({tool}): {why[-1] if why else done.returncode}"
        )
