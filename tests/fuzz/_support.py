"""What every fuzz test shares: reproducible hypothesis settings scaled for the soak,
and a real SQLite-backed ledger (one engine: the parsers, not the store, are
under test here, and the PostgreSQL ledger is fuzzed by nobody's input)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from proctor.broker import (
    Broker,
    EgressProxy,
    Handlers,
    RunScope,
)
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.policy import capability_policies, compile_policies
from proctor.store import open_store

SOAK = os.environ.get("PROCTOR_SOAK") == "1"
SCALE = 20 if SOAK else 1
#: Per-test timeout for the fuzz modules: x20 the examples outlast the suite's 300 s.
TIMEOUT = 1800 if SOAK else 300


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in ``n`` draws (``integers(0, n - 1) == 0`` is far likelier:
    hypothesis favours boundary values)."""
    return st.sampled_from([True] + [False] * (n - 1))


def fuzz_settings(examples: int, **extra: Any) -> settings:
    """``examples`` cases in ``make test`` (x20 in the soak), the same ones every run:
    derandomized and without an example database, so CI sees what a laptop saw."""
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
        ],
        # PROCTOR_FUZZ_NO_SHRINK=1 while working on a failure: report it at once.
        phases=[Phase.explicit, Phase.generate]
        if os.environ.get("PROCTOR_FUZZ_NO_SHRINK") == "1"
        else list(Phase),
        **extra,
    )


@contextmanager
def sqlite_ledger(tmp: Path, tenant: str = "acme") -> Iterator[Ledger]:
    """A real ledger on a SQLite file, with ``tenant``'s log created.

    The file lives in /dev/shm when there is one: every call a fuzzer makes is
    recorded, and an fsync per call on a disk would be most of the test's time;
    the ledger is not what these tests put under load."""
    shm = Path("/dev/shm")
    where = Path(tempfile.mkdtemp(prefix="proctor-fuzz-", dir=shm)) if shm.is_dir() else tmp
    store = open_store(str(where / "proctor.db"), create=True)
    ledger = Ledger(store, Signer.generate("test.local"), "test.local")
    ledger.create_log(tenant, EventDraft(Actor("operator", "fuzz"), "tenant.create", "tenant/x"))
    try:
        yield ledger
    finally:
        ledger.close()
        store.close()
        if where != tmp:
            shutil.rmtree(where, ignore_errors=True)


@dataclass
class Served:
    """A real Broker serving one run on a Unix socket, with every real handler."""

    broker: Broker
    socket: Path
    token: str
    ledger: Ledger
    scope: RunScope
    errors: list[logging.LogRecord]  # what the broker logged at ERROR: a bug if any


class _Collect(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


@contextmanager
def served_broker(
    tmp: Path, caps: dict[str, Any], proxy: EgressProxy, **scope: Any
) -> Iterator[Served]:
    errors: list[logging.LogRecord] = []
    handler = _Collect(errors)
    logging.getLogger("proctor.broker").addHandler(handler)
    handlers = Handlers.for_proxy(proxy)
    try:
        with sqlite_ledger(tmp) as ledger, Broker(handlers, os.urandom(32)) as broker:
            run = RunScope(
                tenant="acme",
                run_id="r1",
                workload="spiffe://test.local/tenant/acme/deployment/churn/run/r1",
                deployment="churn",
                artifact="sha256:" + "ab" * 32,
                approvals=("approval-1",),
                environment="production",
                policies=compile_policies(capability_policies("acme", "churn", caps)),
                ledger=ledger,
                lineage_key=b"k" * 32,
                **scope,
            )
            channel = broker.open_run(run, ttl=3600)
            yield Served(broker, channel.socket, channel.token, ledger, run, errors)
    finally:
        logging.getLogger("proctor.broker").removeHandler(handler)


def exchange(path: Path, data: bytes, timeout: float = 15.0) -> bytes:
    """Send ``data`` on a Unix socket, half-close, read the answer until it closes."""
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before reading everything: fine
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)
