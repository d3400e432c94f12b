"""Issue 19: nodes killed and cut off, each in a network namespace of its own.

Three ``proctor serve`` nodes, each in a network namespace with its own address,
reach one PostgreSQL server that runs in a fourth namespace (a bridge joins
them; the test makes all four and removes them). A service writes a bucket
object every few tenths of a second and prints each answer; a schedule fires
every two seconds.

First the service's node is SIGKILLed: the service comes back on another node
within the lease and a restart, its run is recorded interrupted once, and every
answer it printed before dying is in the ledger. Then the node now running the
service has its link set down: it cannot renew its lease, so it stops its run
and exits; another node marks it dead, records its run as interrupted once and
starts the service. Each dead node is started again, as a new node. Nothing a
dead node wrote lands after its run's end, nothing is recorded twice, each tick
fired once, and every log verifies.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.lifecycle import nodes
from proctor.testing import PostgresServer, PostgresUnavailable
from tests.conftest import wait_until
from tests.e2e.conftest_gov import Gov, build_gov
from tests.pg.cluster_support import ServeNodes, events_of, runs_of
from tests.sandbox_conftest_helpers import any_backend, unavailable

pytestmark = [pytest.mark.postgres, pytest.mark.sandbox]

LEASE = 3.0
EVERY = 2.0
# Every answer the service gets is printed; the ledger must hold its event.
WRITER = """
import os, time
import proctor_guest as g
run = os.environ["PROCTOR_RUN"]
for i in range(100000):
    key = f"{run}/{i}.txt"
    res = g.write("reports", key, f"{run} {i}".encode())
    print(f"ANSWER {key} {res['sha256']}", flush=True)
    time.sleep(0.3)
"""
CAPS = '[buckets]\nreports = "write"\n'
TICK = 'print("tick", flush=True)\n'


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def _network(count: int) -> Iterator[tuple[str, list[str], str]]:
    """A hub namespace with a bridge, and ``count`` namespaces each joined to it by
    a veth pair: (hub, nodes, the subnet's first three octets)."""
    tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
    net = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
    hub, members = f"pxh{tag}", [f"pxn{tag}{i}" for i in range(count)]
    made: list[str] = []
    try:
        for ns in (hub, *members):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "addr", "add", f"{net}.1/24", "dev", "br0")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, ns in enumerate(members):
            _ip("-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", f"h{i}",
                "netns", hub)  # fmt: skip
            _ip("-n", hub, "link", "set", f"h{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{net}.{10 + i}/24", "dev", "v0")
            _ip("-n", ns, "link", "set", "v0", "up")
        yield hub, members, net
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


class Nodes(ServeNodes):
    def __init__(self, homes: list[Path], spaces: list[str], backend: str, logs: Path) -> None:
        super().__init__(homes, backend, logs, LEASE)
        self.spaces = spaces

    def start(self, i: int) -> None:
        # nsenter, not ip netns exec: that one mounts a new /sys for the namespace,
        # without the cgroup hierarchies a sandbox's limits are written in.
        self.spawn(i, prefix=("nsenter", f"--net=/run/netns/{self.spaces[i]}"))


def _traces(run_id: str) -> list[str]:
    """Processes or cgroups that still name the run."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if run_id.encode() in (entry / "cmdline").read_bytes():
                    found.append(f"pid {entry.name}")
    for root in Path("/sys/fs/cgroup").iterdir():
        if root.is_dir():
            found += [str(p) for p in root.glob(f"*{run_id}*")]
    return found


def test_nodes_killed_and_cut_off_hand_their_work_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("ip") is None:
        unavailable("iproute2", "the ip command is missing")
    backend = any_backend()[0]
    with _network(3) as (hub, spaces, net):
        server = PostgresServer(durable=False, netns=hub, address=f"{net}.1",
                                clients=f"{net}.0/24")  # fmt: skip
        try:
            server.start()
        except PostgresUnavailable as exc:
            unavailable("PostgreSQL", exc.message)
        gov: Gov | None = None
        cluster: Nodes | None = None
        try:
            tcp = server.create_database("cluster")
            # The test reads the store through the server's Unix socket; the nodes
            # reach it over their own links only.
            monkeypatch.setenv("PROCTOR_STORE", server.local_dsn("cluster"))
            gov = build_gov(tmp_path / "t")
            for name, main, mode in (("svc", WRITER, "service"), ("tick", TICK, "schedule")):
                every = f'every = "{EVERY:g}s"\n' if mode == "schedule" else ""
                caps = CAPS if mode == "service" else ""
                art = gov.artifact_dir(name, main,
                                       f'{caps}[lifecycle]\nmode = "{mode}"\n{every}')  # fmt: skip
                gov.rt.deployments.deploy(
                    "acme", gov.rt.artifacts.get("acme", gov.submit("acme", art)), name,
                    environment="sandbox", mode=mode,
                    every_seconds=EVERY if mode == "schedule" else None,
                    instruction="cut test", actor=gov.op,
                )  # fmt: skip
            homes = []
            for i in range(3):
                home = tmp_path / f"n{i}" / "home"
                shutil.copytree(gov.home, home, ignore=shutil.ignore_patterns("serve.lock"))
                config = json.loads((home / "config.json").read_text())
                config["store"] = tcp
                (home / "config.json").write_text(json.dumps(config))
                homes.append(home)
            logs = tmp_path / "logs"
            logs.mkdir()
            cluster = Nodes(homes, spaces, backend, logs)
            _exercise(gov, cluster)
        finally:
            if cluster is not None:
                cluster.stop()
            if gov is not None:
                gov.rt.close()
            server.stop()


def _live(gov: Gov, count: int) -> bool:
    return len([n for n in nodes(gov.rt.store) if n.state == "live"]) == count


def _serving(gov: Gov, but: str | None = None) -> Any:
    return next((r for r in runs_of(gov, "svc") if r[1] == "running" and r[0] != but), None)


def _victim(cluster: Nodes, node: str) -> int:
    # nsenter enters the namespace and execs serve: the node's pid is ours.
    return next(i for i, p in cluster.procs.items()
                if p.poll() is None and node.split(":")[1] == str(p.pid))  # fmt: skip


def _exercise(gov: Gov, cluster: Nodes) -> None:
    for i in range(3):
        cluster.start(i)
    wait_until(lambda: _live(gov, 3), "three live nodes")
    first = wait_until(lambda: _serving(gov), "the service")
    wait_until(lambda: len(runs_of(gov, "tick")) >= 3, "three ticks", timeout=90)

    # 1. SIGKILL the service's node.
    killed = _victim(cluster, first[2])
    cluster.procs[killed].send_signal(signal.SIGKILL)
    cluster.procs[killed].wait(30)
    killed_at = time.monotonic()
    second = wait_until(lambda: _serving(gov, but=first[0]), "the service elsewhere", 60)
    assert second[2] != first[2]
    assert time.monotonic() - killed_at < LEASE + 30
    old = next(r for r in runs_of(gov, "svc") if r[0] == first[0])
    assert old[1] == "interrupted" and old[3] in ("supervisor died", "node lease lapsed"), old
    cluster.start(killed)  # started again by its service manager: a new node
    wait_until(lambda: _live(gov, 3), "the killed node back, as a new one")

    # 2. Cut the node now running the service off the network.
    cut = _victim(cluster, second[2])
    _ip("-n", cluster.spaces[cut], "link", "set", "v0", "down")
    gone = cluster.procs[cut]
    gone.wait(90)
    assert gone.returncode not in (0, None), "a node that lost its lease exits non-zero"
    assert any(d["node"] == second[2] for d in cluster.lines("node.lost"))
    # It stopped its run: nothing of the sandbox is left.
    wait_until(lambda: not _traces(second[0]), "the cut node's sandbox to be gone", 30)
    third = wait_until(lambda: _serving(gov, but=second[0]), "the service taken over", 60)
    assert third[2] != second[2]
    old = next(r for r in runs_of(gov, "svc") if r[0] == second[0])
    assert old[1] == "interrupted" and old[3] == "node lease lapsed", old
    _ip("-n", cluster.spaces[cut], "link", "set", "v0", "up")
    cluster.start(cut)
    wait_until(lambda: _live(gov, 3), "the cut node back, as a new one")
    wait_until(lambda: _serving(gov) is not None and len(runs_of(gov, "tick")) >= 8,
               "more ticks", timeout=60)  # fmt: skip
    cluster.stop()
    _check(gov, cluster, dead={first[2]: first[0], second[2]: second[0]})


def _check(gov: Gov, cluster: Nodes, dead: dict[str, str]) -> None:
    events = events_of(gov)
    for node, run_id in dead.items():
        ends = [e for e in events if e["action"] == "run.end" and e.get("run") == run_id]
        assert len(ends) == 1, ends
        # Nothing the dead node wrote lands after the end another node recorded.
        mine = [e["seq"] for e in events if e["actor"]["id"] == f"supervisor:{node}"
                or (e.get("run") == run_id and e is not ends[0])]  # fmt: skip
        assert mine and max(mine) < ends[0]["seq"], (node, mine, ends[0]["seq"])
    starts = Counter(e["run"] for e in events
                     if e["action"] == "run.start" and e.get("decision") == "allow")  # fmt: skip
    finished = Counter(e["run"] for e in events if e["action"] == "run.end")
    assert max(starts.values()) == 1 and max(finished.values()) == 1
    assert set(starts) == set(finished), "a run without its end"
    # Every answer a service run printed (whichever node, killed or cut) was recorded.
    writes = {e["resource"]: e["details"]["sha256"] for e in events
              if e["action"] == "file.write" and e["decision"] == "allow"}  # fmt: skip
    answers = 0
    for home in cluster.homes:
        for log in (home / "runs").glob("*/stdout.log"):
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("ANSWER "):
                    _, key, digest = line.split()
                    assert writes.get(f"bucket/reports/{key}") == digest, f"{key}: not recorded"
                    answers += 1
    assert answers > 0
    ticks = Counter(d["tick"] for d in cluster.lines("schedule.fire"))
    assert max(ticks.values()) == 1, ticks
    # The ticks go to the nodes with room: more than one of them.
    assert len({r[2] for r in runs_of(gov, "tick")}) >= 2
    assert gov.rt.ledger.verify("acme").size == len(events)
    gov.rt.ledger.verify("system")
    states = Counter(n.state for n in nodes(gov.rt.store))
    assert states == {"left": 3, "dead": 2}, states
