"""What one client may hold of ``witness serve``.

A witness answers anyone who can reach it (add-checkpoint is authenticated by the
log's signature, the read by nothing), one thread and one descriptor per
connection. Without bounds, one client opening connections and never finishing a
request would hold every descriptor, and the logs it witnesses could get no
cosignature. So:

* the descriptor limit's soft value is raised to the hard one at start, and the
  server holds at most that many connections less a reserve (SQLite's files, the
  listening socket, the standard streams), and never more than ``MAX_TOTAL``;
* one client address (an IPv6 client by its /64) holds at most ``per_address`` of
  them, at most a quarter of the total, so three quarters stay for others;
* a request must arrive whole (request line, headers and body) within
  ``request_timeout`` seconds of the connection being ready for it, so a client
  that sends slowly, or keeps an idle connection, is closed by a reaper thread
  whatever pace its bytes come at (a per-read timeout alone would let a byte every
  few seconds hold the connection forever).

Refused connections are answered ``503`` without being read, and counted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import resource
import socket
import threading
import time
from collections.abc import Callable

#: Descriptors kept for everything but connections: the state database and its
#: WAL, the key, the listening socket, the standard streams, and slack.
RESERVE = 64
#: At most this many connections at once whatever the descriptor limit (one thread each).
MAX_TOTAL = 1024
#: The default bound per client address.
PER_ADDRESS = 32
#: The default time a client has to send one whole request, or to start the next.
REQUEST_TIMEOUT = 10.0


def raise_nofile() -> int:
    """Raise this process's soft descriptor limit to its hard limit; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # a limit the kernel refuses: serve within the one we have
    return soft


def total_for(soft: int) -> int:
    """How many connections a process with ``soft`` descriptors may hold."""
    return max(8, min(MAX_TOTAL, soft - RESERVE))


def client_key(host: str) -> str:
    """The unit a bound counts: an IPv4 address, or an IPv6 client's /64 (one host
    there may hold many addresses)."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class ConnectionGate:
    """Counts the connections held, per client and in total; thread-safe."""

    def __init__(self, per_address: int, total: int) -> None:
        if per_address < 1 or total < 1:
            raise ValueError("connection bounds must be positive")
        self.total = total
        # One client never takes more than a quarter: the rest stays for the others.
        self.per_address = max(1, min(per_address, total // 4))
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._count = 0
        self.refused = 0

    def admit(self, host: str) -> bool:
        key = client_key(host)
        with self._lock:
            if self._count >= self.total or self._held.get(key, 0) >= self.per_address:
                self.refused += 1
                return False
            self._held[key] = self._held.get(key, 0) + 1
            self._count += 1
            return True

    def release(self, host: str) -> None:
        key = client_key(host)
        with self._lock:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)
            self._count = max(0, self._count - 1)

    def held(self) -> int:
        with self._lock:
            return self._count


class Deadlines:
    """Closes (shuts down) a connection whose request did not arrive in time: one
    thread for all connections, waking a few times a second."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, tick: float = 0.2) -> None:
        self._clock = clock
        self._tick = tick
        self._lock = threading.Lock()
        self._due: dict[socket.socket, float] = {}
        self._expired: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="witness-deadlines", daemon=True)
        self.closed = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def arm(self, sock: socket.socket, seconds: float) -> None:
        with self._lock:
            self._due[sock] = self._clock() + seconds

    def disarm(self, sock: socket.socket) -> None:
        with self._lock:
            self._due.pop(sock, None)

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._due.pop(sock, None)
            self._expired.discard(sock)

    def expired(self, sock: socket.socket) -> bool:
        with self._lock:
            return sock in self._expired

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            now = self._clock()
            with self._lock:
                late = [s for s, due in self._due.items() if due <= now]
                for s in late:
                    del self._due[s]
                    self._expired.add(s)
            for s in late:
                self.closed += 1
                # Wakes the handler's blocked read with end-of-file; the handler then
                # drops the connection without answering it (or it was closed meanwhile).
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
