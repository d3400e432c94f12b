"""What the cluster tests share: real ``proctor serve`` nodes, one per home, each
logging to ``logs/node<i>.log``, and reads of the store they share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.conftest import PROCTOR
from tests.e2e.conftest_gov import Gov


class ServeNodes:
    def __init__(self, homes: list[Path], backend: str, logs: Path, lease: float) -> None:
        self.homes, self.backend, self.logs, self.lease = homes, backend, logs, lease
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, i: int, *, prefix: tuple[str, ...] = (), api: tuple[str, ...] = ()) -> None:
        """Start node ``i``'s serve (``prefix`` before it: a namespace to enter)."""
        env = dict(os.environ, PROCTOR_HOME=str(self.homes[i]))
        err = (self.logs / f"node{i}.log").open("ab")
        self.procs[i] = subprocess.Popen(
            [*prefix, PROCTOR, "serve", "--backend", self.backend, *(api or ("--no-api",)),
             "--node-lease", str(self.lease)],
            env=env, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip

    def lines(self, event: str) -> list[dict[str, Any]]:
        """Every node's JSON log lines of ``event``."""
        out = []
        for path in sorted(self.logs.glob("node*.log")):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("{") and f'"{event}"' in line:
                    doc = json.loads(line)
                    if doc.get("event") == event:
                        out.append(doc)
        return out

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def runs_of(gov: Gov, name: str) -> list[Any]:
    """(id, status, supervisor, reason) of a deployment's runs, oldest first."""
    with gov.rt.store.read() as conn:
        return conn.query(
            "SELECT id, status, supervisor, reason FROM runs WHERE tenant = 'acme'"
            " AND deployment = ? ORDER BY started_at",
            (name,),
        )


def events_of(gov: Gov) -> list[dict[str, Any]]:
    return [json.loads(e) for e in gov.rt.ledger.entries("acme")]
