"""The runtime's witness tables on both engines (SQLite and PostgreSQL): a tenant's
witness, a submission through a real witness (in this process, on loopback), the
stored cosignatures, the status and the witness policy a verifier applies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.errors import AlreadyExists, NotFound, VerificationFailed
from proctor.ledger import EventDraft, verify_receipt
from proctor.witness import (
    TenantWitnesses,
    Witness,
    WitnessServer,
    check_policy,
    witnessed,
    witnessed_receipt,
)
from tests.conftest import OPERATOR, LedgerEnv, draft


@pytest.fixture
def served_witness(tmp_path: Path) -> Iterator[tuple[Witness, str]]:
    w = Witness.init(tmp_path / "w", "witness.test/s1")
    server = WitnessServer(w, "127.0.0.1", 0)
    server.start()
    yield w, "http://{}:{}".format(*server.address)
    server.stop()


def test_witness_tables_on_both_engines(
    ledger_env: LedgerEnv, served_witness: tuple[Witness, str]
) -> None:
    ledger, store = ledger_env.ledger, ledger_env.store
    ledger.create_log("acme", draft(0), hook=lambda conn: conn.execute(
        "INSERT INTO tenants (name, created_at, created_by) VALUES ('acme', '', 'test')"
    ))  # fmt: skip
    w, url = served_witness
    w.add_log(ledger.origin("acme"), ledger.vkey())
    tw = TenantWitnesses(store, ledger)
    tw.use("acme", "s1", w.vkey, url, OPERATOR)
    with pytest.raises(AlreadyExists):
        tw.use("acme", "s1", w.vkey, url, OPERATOR)
    with pytest.raises(NotFound):
        tw.use("nobody", "s1", w.vkey, url, OPERATOR)

    ledger.append("acme", draft(1))
    first = tw.submit("acme")
    assert [(s.ok, s.size) for s in first] == [(True, ledger.head("acme").size)]
    for i in range(2, 6):
        ledger.append("acme", draft(i))
    head = ledger.head("acme")
    assert [s.ok for s in tw.submit("acme")] == [True]  # with a proof from the last size
    assert [s.detail for s in tw.submit("acme")] == ["cosigned already"]

    notes = tw.cosigned_notes("acme")
    assert [n.split("\n")[1] for n in notes] == [str(head.size), str(first[0].size)]
    assert tw.newest_cosigned("acme") == (head.size, notes[0])
    assert tw.newest_cosigned("acme", quorum=2) is None
    assert tw.cosigned("acme", head.checkpoint) == notes[0]
    status = tw.status("acme")
    assert status["per_witness"] == {"s1": head.size} and status["within_policy"] is True
    assert status["uncosigned_for_seconds"] == 0.0

    # The verifier's side: the newest note with the quorum; a quorum the keys cannot
    # meet is refused before anything is read; a receipt made against the note.
    assert witnessed(notes, [w.vkey], check_policy([w.vkey], None)) == (head.size, notes[0])
    receipt = witnessed_receipt(tw, ledger, "acme", "index 2\n")
    assert verify_receipt(receipt, ledger.vkey(), [w.vkey], 1).size == head.size
    ledger.append("acme", EventDraft(OPERATOR, "test.event", "thing/late"))
    late = ledger.head("acme")
    assert witnessed_receipt(tw, ledger, "acme", f"index {late.size - 1}\n") == (
        f"index {late.size - 1}\n"  # not covered by a cosigned checkpoint: left as it was
    )
    with pytest.raises(VerificationFailed):
        other = Witness.init(ledger_env.path.parent / "w2", "witness.test/s2").vkey
        verify_receipt(receipt, ledger.vkey(), [other], 1)

    policy = tw.set_policy("acme", OPERATOR, quorum=1, max_age=60)
    assert tw.policy("acme") == policy and policy.max_age_seconds == 60
    tw.remove("acme", "s1", OPERATOR)
    assert tw.list("acme") == [] and tw.submit("acme") == []
    with pytest.raises(NotFound):
        tw.remove("acme", "s1", OPERATOR)
    actions = [e for e in ledger.entries("acme") if b'"witness.' in e]
    assert len(actions) == 3  # use, policy, remove
