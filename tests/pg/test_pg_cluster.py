"""Issue 19: three ``proctor serve`` nodes on one PostgreSQL store, on loopback.

Three homes (copies of one: the same keys and code, one shared runs/ directory)
each run a real ``serve`` with its API against one PostgreSQL server, with a
service, a schedule and a job deployed. Runs asked of one node's API go to the
nodes with room and stream back through the node asked. (Nodes killed and cut
off, each in a network namespace of its own: test_pg_cluster_cut.py.)
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.lifecycle import nodes
from tests.conftest import wait_until
from tests.e2e.conftest_gov import Gov, build_gov
from tests.pg.cluster_support import ServeNodes, runs_of
from tests.sandbox_conftest_helpers import any_backend

pytestmark = [pytest.mark.postgres, pytest.mark.sandbox]

LEASE = 3.0
EVERY = 2.0
SLEEPER = """
import time
print("serving", flush=True)
time.sleep(600)
"""
TICK = 'print("tick", flush=True)\n'
HELLO = 'import time\nprint("hello from a run", flush=True)\ntime.sleep(3)\nprint("bye")\n'


class Cluster(ServeNodes):
    def __init__(self, gov: Gov, homes: list[Path], backend: str, logs: Path) -> None:
        super().__init__(homes, backend, logs, LEASE)
        self.gov = gov

    def start(self, i: int, api_port: int | None = None) -> None:
        api = () if api_port is None else ("--api-port", str(api_port), "--no-console")
        self.spawn(i, api=api)


@pytest.fixture
def cluster(pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    backend = any_backend()[0]
    monkeypatch.setenv("PROCTOR_STORE", pg_dsn)
    gov = build_gov(tmp_path / "a")
    for name, main, mode in (("svc", SLEEPER, "service"), ("tick", TICK, "schedule"),
                             ("hello", HELLO, "job")):  # fmt: skip
        every = f'every = "{EVERY:g}s"\n' if mode == "schedule" else ""
        art = gov.artifact_dir(name, main, f'[lifecycle]\nmode = "{mode}"\n{every}')
        digest = gov.submit("acme", art)
        gov.rt.deployments.deploy(
            "acme", gov.rt.artifacts.get("acme", digest), name, environment="sandbox",
            mode=mode, every_seconds=EVERY if mode == "schedule" else None,
            instruction="cluster test", actor=gov.op,
        )  # fmt: skip
    # Each node is a home of its own: the same keys, configuration and code; their
    # runs/ directories are one shared directory, as docs/deploy.md asks.
    homes = [gov.home]
    for letter in ("b", "c"):
        other = tmp_path / letter / "home"
        shutil.copytree(gov.home, other, ignore=shutil.ignore_patterns("serve.lock", "runs"))
        homes.append(other)
    shared = tmp_path / "shared-runs"
    shared.mkdir(mode=0o700)
    for home in homes:
        shutil.rmtree(home / "runs", ignore_errors=True)
        (home / "runs").symlink_to(shared)
    logs = tmp_path / "logs"
    logs.mkdir()
    c = Cluster(gov, homes, backend, logs)
    try:
        yield c
    finally:
        c.stop()
        gov.rt.close()


def test_runs_asked_of_one_node_go_where_there_is_room_and_stream_back(
    cluster: Cluster,
) -> None:
    import socket
    import threading

    from proctor.client import Client

    gov = cluster.gov
    ports = []
    for i in range(3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        cluster.start(i, api_port=ports[i])
    wait_until(lambda: len([n for n in nodes(gov.rt.store) if n.state == "live"]) == 3,
               "three live nodes")  # fmt: skip
    wait_until(lambda: any(r[1] == "running" for r in runs_of(gov, "svc")), "the service")
    out: dict[int, tuple[list[str], Any]] = {}

    def ask(k: int) -> None:
        seen: list[str] = []
        url = f"http://127.0.0.1:{ports[0]}"
        with Client(url, gov.token("dev")) as c:
            wait_until(lambda: _answers(c), "node 0's API")
            out[k] = (seen, c.run("acme", "hello", on_stdout=seen.append))

    asks = [threading.Thread(target=ask, args=(k,)) for k in range(4)]
    for t in asks:
        t.start()
    for t in asks:
        t.join(120)
    assert sorted(out) == [0, 1, 2, 3], out
    for seen, record in out.values():
        # Streamed back through node 0, whichever node ran it.
        assert "hello from a run" in "".join(seen) and "bye" in "".join(seen), seen
        assert record["status"] == "succeeded", record
    ran_on = {r[2] for r in runs_of(gov, "hello")}
    assert len(runs_of(gov, "hello")) == 4
    assert len(ran_on) >= 2, f"every run on one node: {ran_on}"
    taken = cluster.lines("request.take")
    assert len(taken) == 4 and len({d["request"] for d in taken}) == 4, taken
    with gov.rt.store.read() as conn:
        states = conn.query("SELECT state, run_id FROM run_requests")
    assert sorted(s for s, _ in states) == ["done"] * 4
    assert {r for _, r in states} == {r[0] for r in runs_of(gov, "hello")}


def _answers(c: Any) -> bool:
    try:
        c.whoami()
    except Exception:
        return False
    return True
