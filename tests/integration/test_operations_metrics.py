"""What the operator's metrics say of witnessing, retention and erasure, read the way
a scrape reads them (the exposition), on SQLite and PostgreSQL.

- witness lag: 0 while a tenant's head is cosigned; behind once its witness is down
  and the log grows; with tenant labels off, one series holding the furthest behind.
- a prune counts the events it pruned; an erasure request counts once, even one that
  found nothing to erase (it was still carried out and recorded).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proctor import telemetry
from proctor.governance import Retention, erase_key
from proctor.ledger import Actor, EventDraft, Ledger
from proctor.witness import Submitter, TenantWitnesses, Witness, WitnessServer
from tests.conftest import OPERATOR, LedgerEnv, draft, wait_until

T = "acme"
OP = Actor("operator", "root")


@pytest.fixture(autouse=True)
def _labels_as_they_were() -> Iterator[None]:
    """These tests turn tenant labels on: the process's other tests find them as
    they were."""
    was = telemetry.tenant_labels()
    yield
    telemetry.enable_metrics(tenant_labels=was)


@pytest.fixture
def labels() -> Iterator[None]:
    """Metrics on (for the rest of this process, as in serve), tenant labels restored."""
    was = telemetry.tenant_labels()
    telemetry.enable_metrics(tenant_labels=was)
    yield
    telemetry.enable_metrics(tenant_labels=was)


def sample(name: str, **labels: str) -> float | None:
    """One sample of the exposition, as Prometheus would read it (None: not there)."""
    body, _ = telemetry.exposition("text/plain")
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


def _tenant(ledger: Ledger, env: LedgerEnv, name: str = T) -> None:
    with env.store.write() as conn:
        conn.execute("INSERT INTO tenants (name, created_at, created_by) VALUES (?, '', 'root')",
                     (name,))  # fmt: skip
    ledger.create_log(name, draft(0))


AGE = "proctor_witness_checkpoint_age_seconds"


def test_witness_lag_is_zero_while_cosigned_and_grows_once_the_witness_is_down(
    ledger_env: LedgerEnv, tmp_path: Path, labels: None
) -> None:
    ledger = ledger_env.ledger
    _tenant(ledger, ledger_env)
    _tenant(ledger, ledger_env, "globex")  # no witness: no series of its own
    w = Witness.init(tmp_path / "w", "witness.test/lag")
    w.add_log(ledger.origin(T), ledger.vkey())
    server = WitnessServer(w, "127.0.0.1", 0)
    server.start()
    tw = TenantWitnesses(ledger_env.store, ledger)
    tw.use(T, "w1", w.vkey, "http://{}:{}".format(*server.address), OPERATOR)
    ledger.append(T, draft(1))
    submitter = Submitter(tw, interval=0.05)
    submitter.start()
    try:
        wait_until(lambda: tw.status(T)["newest_cosigned_size"] == ledger.head(T).size
                   and submitter.behind.get(T, 1.0) is None, "the head cosigned")  # fmt: skip
        telemetry.enable_metrics(tenant_labels=True)
        assert sample(AGE, tenant=T) == 0.0
        assert sample(AGE, tenant="globex") is None
        # The witness goes down; the log grows: the lag is counted from the first
        # checkpoint it has not cosigned. (A new submitter: the old one's kept-alive
        # connection would still be served by the stopped server's handler.)
        submitter.stop()
        server.stop()
        ledger.append(T, draft(2))
        submitter = Submitter(tw, interval=0.05)
        submitter.start()
        wait_until(lambda: submitter.behind.get(T) is not None, "the tenant behind")
        behind = sample(AGE, tenant=T)
        assert behind is not None and behind > 0.0
        assert tw.status(T)["uncosigned_for_seconds"] > 0.0  # what readiness holds it to
        # Tenant labels off: one series without a tenant, the furthest behind.
        telemetry.enable_metrics(tenant_labels=False)
        unlabelled = sample(AGE, tenant="")
        assert unlabelled is not None and unlabelled >= behind
    finally:
        submitter.stop()
        server.stop()


def test_a_prune_counts_its_events_and_an_erasure_request_counts_once(
    ledger_env: LedgerEnv, labels: None
) -> None:
    start = datetime(2025, 1, 1, tzinfo=UTC)
    now = [start]
    ledger = Ledger(ledger_env.store, ledger_env.signer, "test.local",
                    clock=lambda: now[0].strftime("%Y-%m-%dT%H:%M:%S.%fZ"))  # fmt: skip
    try:
        _tenant(ledger, ledger_env)
        for i in range(7):
            now[0] = start + timedelta(days=1, hours=i)
            ledger.append(T, EventDraft(Actor("workload", "run-1"), "sql.select", "table/t",
                                        run="run-1", details={"i": i}))  # fmt: skip
        now[0] = start + timedelta(days=300)
        telemetry.enable_metrics(tenant_labels=True)
        pruned_before = sample("proctor_retention_pruned_events_total", tenant=T) or 0.0
        retention = Retention(ledger_env.store, ledger)
        retention.set(T, 200, OP)
        result = retention.prune(T, OP)
        assert result.pruned >= 7  # the seven reads and the log's first event
        total = pruned_before + result.pruned
        assert sample("proctor_retention_pruned_events_total", tenant=T) == total
        assert retention.prune(T, OP).pruned == 0  # nothing left: nothing counted
        assert sample("proctor_retention_pruned_events_total", tenant=T) == total

        erased_before = sample("proctor_erasures_total", tenant=T) or 0.0
        key = hmac.new(b"k" * 32, b"42", hashlib.sha256).hexdigest()[:32]  # a keyed hash
        erase_key(ledger_env.store, ledger, T, "crm", key, "DSR-2026-0042", OP)
        assert sample("proctor_erasures_total", tenant=T) == erased_before + 1
        # A refused request (its reference names a person) is no erasure.
        with pytest.raises(Exception, match="request reference"):
            erase_key(ledger_env.store, ledger, T, "crm", key, "Jane Doe <j@example.com>", OP)
        assert sample("proctor_erasures_total", tenant=T) == erased_before + 1
    finally:
        ledger.close()
