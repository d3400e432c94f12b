"""Witnesses (C2SP tlog-witness, tlog-cosignature), for real: each witness is a
``proctor witness serve`` subprocess with its own state directory, in a network
namespace the test creates (a veth pair with 10.214.x.y addresses), or on
loopback where namespaces cannot be made (said in the skip-free fallback below).

A log is built with the runtime's own ``Ledger``; a fork is the same log rebuilt
by someone who holds the signing key with one event left out, and re-signed."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from proctor.ledger import Ledger, Signer
from proctor.store import open_store
from proctor.witness import Witness, add_checkpoint_body
from tests.conftest import PROCTOR, draft, run_cli

# Each test makes network namespaces and veth pairs (tests/host_group.py).
pytestmark = pytest.mark.host
ORIGIN = "test.local/tenant/acme"
# One number per namespace made by this process: names and /30 subnets never collide.
_NETNS_NUMBERS = itertools.count()


# ---- witnesses in their own network namespaces -------------------------------------


def _ip(*args: str) -> bool:
    return subprocess.run(["ip", *args], capture_output=True, timeout=10).returncode == 0


@dataclass
class Netns:
    """One network namespace with a veth pair: the host side .1, the witness .2."""

    name: str
    host_ip: str
    ns_ip: str

    @classmethod
    def make(cls, index: int) -> Netns | None:
        tag = f"{os.getpid() % 100000}{index}"
        name, host_if, ns_if = f"pw{tag}", f"pwh{tag}", f"pwn{tag}"
        base = f"10.214.{os.getpid() % 250}"
        host_ip, ns_ip = f"{base}.{index * 4 + 1}", f"{base}.{index * 4 + 2}"
        ok = (
            _ip("netns", "add", name)
            and _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            and _ip("link", "set", ns_if, "netns", name)
            and _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
            and _ip("link", "set", host_if, "up")
            and _ip("-n", name, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
            and _ip("-n", name, "link", "set", ns_if, "up")
            and _ip("-n", name, "link", "set", "lo", "up")
        )
        if not ok:
            cls(name, host_ip, ns_ip).remove()
            return None
        return cls(name, host_ip, ns_ip)

    def remove(self) -> None:
        _ip("link", "del", "pwh" + self.name[2:])
        _ip("netns", "del", self.name)


@dataclass
class WitnessProc:
    """A ``proctor witness serve`` subprocess, restartable on the same state."""

    state: Path
    name: str
    netns: Netns | None
    vkey: str = ""
    url: str = ""
    proc: subprocess.Popen[bytes] | None = None
    port: int = 7380

    def init(self, logs: list[tuple[str, str]], cli: bool = False) -> WitnessProc:
        if not cli:  # the library, as the CLI calls it: a process start saved per witness
            w = Witness.init(self.state, self.name)
            for origin, vkey in logs:
                w.add_log(origin, vkey)
            self.vkey = w.vkey
            return self
        out = run_cli("witness", "init", "--state", str(self.state), "--name", self.name, "--json")
        self.vkey = json.loads(out.out)["vkey"]
        for origin, vkey in logs:
            run_cli("witness", "add-log", "--state", str(self.state), origin, vkey)
        return self

    def start(self) -> WitnessProc:
        host = self.netns.ns_ip if self.netns else "127.0.0.1"
        prefix = ["ip", "netns", "exec", self.netns.name] if self.netns else []
        # On loopback the port is whatever is free; in a namespace the fixed one is ours.
        listen = f"{host}:{self.port if self.netns else (self.port_of_loopback())}"
        self.proc = subprocess.Popen(
            [*prefix, PROCTOR, "witness", "serve", "--state", str(self.state),
             "--listen", listen, "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read().decode() if self.proc.stderr else "no output"
        self.url = "http://" + json.loads(line)["listen"]
        return self

    def port_of_loopback(self) -> int:
        if self.url:  # a restart keeps the address the runtime knows
            return int(self.url.rsplit(":", 1)[1])
        return 0

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def show(self) -> dict[str, object]:
        doc: dict[str, object] = json.loads(
            run_cli("witness", "show", "--state", str(self.state), "--json").out
        )
        return doc


@dataclass
class Witnesses:
    made: list[WitnessProc] = field(default_factory=list)
    nets: list[Netns] = field(default_factory=list)
    in_namespaces: bool = True

    def new(
        self, state: Path, name: str, logs: list[tuple[str, str]], cli: bool = False
    ) -> WitnessProc:
        netns = Netns.make(next(_NETNS_NUMBERS)) if self.in_namespaces else None
        if netns is None:
            # No namespaces here (no CAP_NET_ADMIN, no iproute2): loopback instead.
            self.in_namespaces = False
        else:
            self.nets.append(netns)
        w = WitnessProc(state, name, netns).init(logs, cli)
        self.made.append(w)  # before it starts: a start that fails is stopped too
        return w.start()

    def close(self) -> None:
        for w in self.made:
            w.stop()
        for n in self.nets:
            n.remove()


@pytest.fixture(scope="module")
def witnesses() -> Iterator[Witnesses]:
    ws = Witnesses()
    yield ws
    ws.close()


# ---- an independent check of a cosignature ------------------------------------------


def check_cosignature(line: str, body: str, vkey: str) -> int:
    """Verify a tlog-cosignature/v1 line with `cryptography` alone: the spec's key id
    (algorithm byte 0x04), the timestamp, the signed message. Returns the time."""
    name, hex_id, b64 = vkey.split("+", 2)
    raw_key = base64.b64decode(b64)
    assert raw_key[0] == 0x04 and len(raw_key) == 33
    assert hashlib.sha256(name.encode() + b"\n\x04" + raw_key[1:]).digest()[:4].hex() == hex_id
    dash, sig_name, sig_b64 = line.rstrip("\n").split(" ")
    assert dash == "\u2014" and sig_name == name
    sig = base64.b64decode(sig_b64)
    assert len(sig) == 4 + 8 + 64 and sig[:4].hex() == hex_id
    stamp = int.from_bytes(sig[4:12], "big")
    message = f"cosignature/v1\ntime {stamp}\n{body}".encode()
    Ed25519PublicKey.from_public_bytes(raw_key[1:]).verify(sig[12:], message)
    return stamp


def body_of(note: str) -> str:
    return note.rpartition("\n\n")[0] + "\n"


# ---- the protocol --------------------------------------------------------------------


@dataclass
class Logs:
    honest: Ledger
    forked: Ledger
    signer: Signer


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logs]:
    tmp = tmp_path_factory.mktemp("witness-logs")
    signer = Signer.generate("test.local")
    honest = Ledger(open_store(str(tmp / "honest.db"), create=True), signer, "test.local")
    forked = Ledger(open_store(str(tmp / "forked.db"), create=True), signer, "test.local")
    yield Logs(honest, forked, signer)
    honest.close()
    forked.close()


def post(w: WitnessProc, old: int, proof: list[bytes], note: str) -> httpx.Response:
    return httpx.post(w.url + "/add-checkpoint", content=add_checkpoint_body(old, proof, note),
                      timeout=10)  # fmt: skip


def test_cosigns_consistent_checkpoints_and_refuses_forks_rollbacks_and_races(
    logs: Logs, witnesses: Witnesses, tmp_path: Path
) -> None:
    honest, forked = logs.honest, logs.forked
    honest.create_log("acme", draft(0))
    for i in range(1, 5):
        honest.append("acme", draft(i))
    w = witnesses.new(tmp_path / "w1", "witness.test/w1", [(ORIGIN, honest.vkey())], cli=True)
    assert honest.origin("acme") == ORIGIN

    # A first checkpoint: cosigned, and the line verifies with an independent check.
    five = honest.head("acme")
    r = post(w, 0, [], five.checkpoint)
    assert r.status_code == 200, r.text
    assert r.text.startswith("\u2014 witness.test/w1 ") and r.text.endswith("\n")
    stamp = check_cosignature(r.text, body_of(five.checkpoint), w.vkey)
    assert abs(stamp - time.time()) < 3600

    # Grown by three: cosigned with the consistency proof from the size it holds.
    for i in range(5, 8):
        honest.append("acme", draft(i))
    eight = honest.head("acme")
    proof = list(honest.consistency_proof("acme", 5, 8).hashes)
    r = post(w, 5, proof, eight.checkpoint)
    assert r.status_code == 200, r.text
    check_cosignature(r.text, body_of(eight.checkpoint), w.vkey)

    # Rollback: the old checkpoint again. From its own size: 409 with the witness's
    # size; from the witness's size: 400 (old size above the checkpoint's).
    r = post(w, 5, [], five.checkpoint)
    assert (r.status_code, r.headers["content-type"], r.text) == (409, "text/x.tlog.size", "8\n")
    assert post(w, 8, [], five.checkpoint).status_code == 400

    # A fork: the log rebuilt without event 3, re-signed with the real key, at the same
    # size (another root) and larger (a proof that holds only for the forked tree).
    forked.create_log("acme", draft(0))
    for i in [1, 2, 4, 5, 6, 7, 8]:
        forked.append("acme", draft(i))
    f8 = forked.head("acme")
    assert f8.size == 8 and f8.root != eight.root
    r = post(w, 8, [], f8.checkpoint)
    assert r.status_code == 422, r.text
    forked.append("acme", draft(9))
    forked.append("acme", draft(10))
    f10 = forked.head("acme")
    r = post(w, 8, list(forked.consistency_proof("acme", 8, 10).hashes), f10.checkpoint)
    assert r.status_code == 422, r.text
    # ... and from 0 (as if the witness were new): 409, it knows better.
    assert post(w, 0, [], f10.checkpoint).status_code == 409

    # The spec's other refusals: unknown origin 404; no trusted signature 403; a
    # trusted key's signature that fails 403; a proof from size 0 422; garbage 400.
    stranger = Signer.generate("test.local")
    alien = Ledger(open_store(str(tmp_path / "alien.db"), create=True), stranger, "test.local")
    try:
        alien.create_log("acme", draft(0))
        assert post(w, 8, [], alien.head("acme").checkpoint).status_code == 403
        alien.create_log("other", draft(0))
        assert post(w, 0, [], alien.head("other").checkpoint).status_code == 404
    finally:
        alien.close()
    text, _, sig = eight.checkpoint.rpartition("\n\n")
    legacy = next(line for line in sig.splitlines() if line.split(" ")[1] == "test.local")
    raw = bytearray(base64.b64decode(legacy.split(" ")[2]))
    raw[-1] ^= 1
    bad = f"{text}\n\n\u2014 test.local {base64.b64encode(bytes(raw)).decode()}\n"
    assert post(w, 8, [], bad).status_code == 403
    assert post(w, 0, [b"\0" * 32], eight.checkpoint).status_code == 409  # old 0 != 8 first
    assert httpx.post(w.url + "/add-checkpoint", content=b"old 08\n\n" + eight.checkpoint.encode()
                      ).status_code == 400  # fmt: skip
    assert httpx.post(w.url + "/add-checkpoint", content=b"hello").status_code == 400
    assert w.show()["logs"][0]["size"] == 8  # type: ignore[index]  # nothing moved it

    # Two requests from the same old size at once: exactly one advances the witness.
    honest.append("acme", draft(8))
    nine = honest.head("acme")
    honest.append("acme", draft(9))
    ten = honest.head("acme")
    bodies = [
        (8, list(honest.consistency_proof("acme", 8, 9).hashes), nine.checkpoint),
        (8, list(honest.consistency_proof("acme", 8, 10).hashes), ten.checkpoint),
    ] * 3
    barrier = threading.Barrier(len(bodies))
    codes: list[int] = []

    def send(old: int, proof: list[bytes], note: str) -> None:
        barrier.wait()
        codes.append(post(w, old, proof, note).status_code)

    threads = [threading.Thread(target=send, args=b) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200, 409, 409, 409, 409, 409], codes
    size = w.show()["logs"][0]["size"]  # type: ignore[index]
    assert size in (9, 10)

    # A restart keeps the state: the same size, and a rollback still refused.
    w.stop()
    w.start()
    assert w.show()["logs"][0]["size"] == size  # type: ignore[index]
    r = post(w, 8, list(honest.consistency_proof("acme", 8, 9).hashes), nine.checkpoint)
    assert r.status_code == 409 and r.text == f"{size}\n"
    # The monitoring read serves the last cosigned checkpoint with its cosignature.
    origin_hash = hashlib.sha256(ORIGIN.encode()).hexdigest()
    got = httpx.get(f"{w.url}/{origin_hash}/checkpoint", timeout=10)
    assert got.status_code == 200
    last = got.text.rpartition("\n\n")[2].strip().split("\n")[-1]
    check_cosignature(last, body_of(got.text), w.vkey)
    if os.geteuid() == 0:  # root makes namespaces: the witness was never on loopback
        assert witnesses.in_namespaces and w.url.startswith("http://10.214.")
