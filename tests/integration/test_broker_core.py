"""The broker core with real sandboxes: per-run sockets, tokens, the guest library,
the shim, and what happens when the broker is gone."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import Broker, Handlers, RunScope
from proctor.ledger import Ledger
from proctor.lifecycle import brokered_spec, run_brokered
from proctor.policy import compile_policies
from proctor.sandbox import Limits, get_driver, run_captured
from tests.conftest import LedgerEnv, draft
from tests.sandbox_conftest_helpers import BACKENDS

pytestmark = pytest.mark.sandbox


async def _never(*args: Any) -> Any:
    raise AssertionError("this test makes no data-plane call")


NO_CALLS = Handlers(connect=_never, forward=_never)


def _scope(ledger: Ledger, run: str, **kw: Any) -> RunScope:
    return RunScope(
        tenant="acme",
        run_id=run,
        workload=f"spiffe://test.local/tenant/acme/deployment/churn/run/{run}",
        deployment="churn",
        artifact="sha256:" + "ab" * 32,
        approvals=(),
        environment="sandbox",
        policies=compile_policies(""),
        ledger=ledger,
        **kw,
    )


@pytest.fixture
def broker(ledger_env: LedgerEnv):  # type: ignore[no-untyped-def]
    ledger_env.ledger.create_log("acme", draft(0))
    with Broker(NO_CALLS, os.urandom(32)) as b:
        yield b


def _events(ledger: Ledger) -> list[dict[str, Any]]:
    return [json.loads(e) for e in ledger.entries("acme")]


WHOAMI = "import json, proctor_guest; print(json.dumps(proctor_guest.whoami()))"


@pytest.mark.parametrize("backend", BACKENDS)
def test_guest_reaches_its_own_run_through_the_shim(
    broker: Broker, ledger_env: LedgerEnv, backend: str
) -> None:
    scope = _scope(ledger_env.ledger, "r1")
    out: list[bytes] = []
    err: list[bytes] = []
    result = run_brokered(
        broker,
        scope,
        get_driver(backend),
        ("python3", "-c", WHOAMI),
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert result.exit_code == 0, b"".join(err).decode()
    who = json.loads(b"".join(out))
    assert who["run"] == "r1"
    assert who["workload"] == scope.workload
    assert who["tenant"] == "acme"


FORGE = r"""
import os, proctor_guest
good = os.environ["PROCTOR_TOKEN"]
cases = {
    "missing": "",
    "forged": "pt1.r2." + good.split(".")[2] + "." + "A" * 43,
    "other_run": os.environ["OTHER_TOKEN"],
    "garbage": "hello",
}
for name, tok in cases.items():
    os.environ["PROCTOR_TOKEN"] = tok
    try:
        proctor_guest.whoami()
        print(name, "ACCEPTED")
    except proctor_guest.GuestError as e:
        print(name, e.code)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_forged_missing_and_other_runs_tokens_are_refused_and_recorded(
    broker: Broker, ledger_env: LedgerEnv, backend: str
) -> None:
    other = broker.open_run(_scope(ledger_env.ledger, "r2"), ttl=60)
    try:
        scope = _scope(ledger_env.ledger, "r1")
        out: list[bytes] = []
        err: list[bytes] = []
        result = run_brokered(
            broker,
            scope,
            get_driver(backend),
            ("python3", "-c", FORGE),
            env={"OTHER_TOKEN": other.token},
            on_stdout=out.append,
            on_stderr=err.append,
        )
    finally:
        broker.close_run("r2")
    assert result.exit_code == 0, b"".join(err).decode()
    lines = b"".join(out).decode().split()
    assert lines == [
        "missing",
        "unauthenticated",
        "forged",
        "unauthenticated",
        "other_run",
        "unauthenticated",
        "garbage",
        "unauthenticated",
    ]
    refusals = [e for e in _events(ledger_env.ledger) if e["action"] == "broker.auth"]
    assert len(refusals) == 4
    assert all(e["decision"] == "deny" and e["run"] == "r1" for e in refusals)
    assert {e["reason"] for e in refusals} >= {
        "token belongs to another run",
        "missing Proctor-Token header",
    }


ESCAPE = r"""
import os, socket, proctor_guest
try:
    proctor_guest.whoami()
    print("broker REACHABLE")
except proctor_guest.BrokerUnavailable:
    print("broker unavailable")
import urllib.request
try:
    urllib.request.urlopen("http://example.com/", timeout=5)
    print("http REACHABLE")
except Exception as e:
    print("http refused")
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_the_broker_there_is_no_way_out(
    ledger_env: LedgerEnv, tmp_path: Path, backend: str
) -> None:
    ledger_env.ledger.create_log("acme", draft(0))
    broker = Broker(NO_CALLS, os.urandom(32)).start()
    channel = broker.open_run(_scope(ledger_env.ledger, "r1"), ttl=60)
    # Keep a copy of the socket path, then stop the broker: its socket disappears.
    broker.stop()
    assert not channel.socket.exists()
    # The sandbox still gets a (dead) socket file where the broker's was.
    channel.socket.parent.mkdir(parents=True, exist_ok=True)
    import socket as pysocket

    dead = pysocket.socket(pysocket.AF_UNIX)
    dead.bind(str(channel.socket))
    dead.close()  # bound but not listening: connections are refused
    try:
        spec = brokered_spec(channel, ("python3", "-c", ESCAPE), limits=Limits(wall_seconds=30))
        run = run_captured(get_driver(backend), spec)
    finally:
        channel.socket.unlink(missing_ok=True)
    assert run.result.exit_code == 0, run.stderr.decode()
    assert run.stdout.decode().split("\n")[:2] == ["broker unavailable", "http refused"]
