"""The runtime's side of witnessing, for real: a tenant uses two witnesses (each a
``proctor witness serve`` in its own network namespace), the submitter thread sends
them new checkpoints beside the appends, a witness that is down is caught up when it
comes back, and ``audit verify --witness`` passes on the honest home while it fails
on a home whose operator rebuilt the log without one event and re-signed it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from proctor.errors import UsageError
from proctor.ledger import Actor, EventDraft, Ledger
from proctor.runtime import Runtime
from proctor.witness import Submitter, TenantWitnesses, check_policy
from tests.conftest import copy_home, run_cli
from tests.integration.test_witness import (  # noqa: F401  (the fixture)
    Witnesses,
    check_cosignature,
    witnesses,
)

# Each test makes network namespaces and veth pairs (tests/host_group.py).
pytestmark = pytest.mark.host
OP = Actor("operator", "test-operator")


def _until(what: Callable[[], bool], message: str) -> None:
    """Wait for a background effect (the submitter's next pass); no time is asserted."""
    deadline = time.monotonic() + 60
    while not what():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def _fork(home: Path, tenant: str, drop: int, extra: int) -> None:
    """What an operator holding the signing key can do: rebuild ``tenant``'s log
    without event ``drop`` (plus ``extra`` new events), every checkpoint re-signed."""
    rt = Runtime.open(home)
    try:
        events = [json.loads(d) for d in rt.ledger.entries(tenant)]
        with rt.store.write() as conn:
            for table in ("ledger_entries", "ledger_tiles", "ledger_checkpoints", "ledger_logs"):
                conn.execute(f"DELETE FROM {table} WHERE log = ?", (tenant,))
        ledger = Ledger(rt.store, rt.signer, rt.config.trust_domain)
        drafts = [
            EventDraft(Actor(e["actor"]["type"], e["actor"]["id"]), e["action"], e["resource"],
                       e["decision"], tuple(e["policies"]), e["reason"], e["deployment"],
                       e["run"], e["artifact"], tuple(e["approvals"]), e["details"])
            for e in events if e["seq"] != drop
        ] + [EventDraft(OP, "test.filler", f"thing/{i}") for i in range(extra)]  # fmt: skip
        ledger.create_log(tenant, drafts[0])
        for d in drafts[1:]:
            ledger.append(tenant, d)
        ledger.close()
    finally:
        rt.close()


def test_submitter_catches_up_and_verify_holds_the_log_to_its_witnesses(
    home: Path,
    witnesses: Witnesses,  # noqa: F811
    tmp_path: Path,
) -> None:
    rt = Runtime.open(home)
    rt.tenants.create("acme", OP)
    origin, vkey = rt.ledger.origin("acme"), rt.ledger.vkey()
    tw = TenantWitnesses(rt.store, rt.ledger)
    w1 = witnesses.new(tmp_path / "w1", "witness.test/r1", [(origin, vkey)])
    w2 = witnesses.new(tmp_path / "w2", "witness.test/r2", [(origin, vkey)])
    # Bad input is refused before anything is written: the log's own key (a note
    # key, 0x01) is not a witness key, a URL must be http(s), names are checked.
    size = rt.ledger.head("acme").size
    for name, key, url in [
        ("r1", vkey, w1.url),
        ("r1", w1.vkey, "ftp://x"),
        ("R 1", w1.vkey, w1.url),
    ]:
        with pytest.raises(UsageError):
            tw.use("acme", name, key, url, OP)
    assert rt.ledger.head("acme").size == size and tw.list("acme") == []
    run_cli("witness", "use", "-t", "acme", "r1", w1.vkey, w1.url, home=home)
    tw.use("acme", "r2", w2.vkey, w2.url, OP)
    listed = tw.status("acme")
    assert [w["name"] for w in listed["witnesses"]] == ["r1", "r2"]
    # Nothing cosigned yet, but the log is younger than the tenant's max age.
    assert listed["newest_cosigned_size"] is None and listed["within_policy"] is True
    policy_set = tw.set_policy("acme", OP, quorum=2, max_age=600)
    assert policy_set.as_json() == {"quorum": 2, "max_age_seconds": 600}
    events = [json.loads(e) for e in rt.ledger.entries("acme")]
    assert [(e["action"], e["resource"]) for e in events if e["action"].startswith("witness.")] == [
        ("witness.use", "witness/r1"), ("witness.use", "witness/r2"),
        ("witness.policy", "tenant/acme"),
    ]  # fmt: skip

    submitter = Submitter(tw, interval=0.05)
    submitter.start()
    try:
        head = rt.ledger.head("acme")
        _until(lambda: tw.status("acme")["per_witness"] == {"r1": head.size, "r2": head.size},
               "both witnesses cosign the head")  # fmt: skip

        # w2 goes down: appends (each one a call's record) go on and are durable at
        # once; w1 keeps cosigning, w2 falls behind.
        w2.stop()
        for i in range(20):
            rt.ledger.append("acme", EventDraft(OP, "test.call", f"thing/{i}"))
        head = rt.ledger.head("acme")
        _until(lambda: tw.status("acme")["per_witness"]["r1"] == head.size, "w1 keeps up")
        assert tw.status("acme")["per_witness"]["r2"] < head.size
        passes = submitter.passes
        _until(lambda: submitter.passes > passes + 2, "the submitter keeps trying")
        # w2 comes back on its state: caught up from its last size with one proof.
        w2.start()
        _until(lambda: tw.status("acme")["per_witness"]["r2"] == head.size, "w2 catches up")
        status = tw.status("acme")
        assert status["within_policy"] is True and status["newest_cosigned_size"] == head.size
        # The stored cosignatures verify independently, on the checkpoint the log signed.
        note = tw.cosigned_notes("acme")[0]
        rt.ledger.export("acme", tmp_path / "export")
    finally:
        submitter.stop()
        rt.close()
    body, _, sigs = note.rpartition("\n\n")
    lines = sigs.strip().split("\n")
    # The log's signature(s), then the two cosignatures.
    for w, line in zip((w1, w2), lines[-2:], strict=True):
        check_cosignature(line, body + "\n", w.vkey)

    policy = ["--witness", w1.vkey, "--witness", w2.vkey]
    ok = run_cli("audit", "verify", "-t", "acme", *policy, "--witness-quorum", "2", "--json",
                 home=home)  # fmt: skip
    assert json.loads(ok.out)["witnessed_size"] == head.size
    # An export is held to a cosigned checkpoint the auditor holds (a receipt's, the
    # served log/checkpoint): its own checkpoint file carries no cosignature.
    (tmp_path / "cosigned.note").write_text(note)
    exported = run_cli("audit", "verify", "--from-export", str(tmp_path / "export"), "--key", vkey,
                       "--checkpoint", str(tmp_path / "cosigned.note"), *policy,
                       "--witness-offline", "--json")  # fmt: skip
    assert json.loads(exported.out)["witnessed_size"] == head.size
    assert "witnesses not asked" in exported.err
    # Without --witness-offline an export is refused: the witnesses cannot be asked
    # about a copy whose log has grown since.
    unasked = run_cli("audit", "verify", "--from-export", str(tmp_path / "export"), "--key",
                      vkey, *policy, check=False)  # fmt: skip
    assert unasked.code == 2 and "--witness-offline" in unasked.err, unasked.err
    with pytest.raises(UsageError, match="--witness-quorum 3"):
        check_policy([w1.vkey, w2.vkey, w1.vkey], 3)  # one witness twice is one witness

    # The operator rebuilds the log without event 2 and re-signs it, at a larger size.
    forked = copy_home(home, tmp_path / "forked")
    _fork(forked, "acme", drop=2, extra=3)
    rt = Runtime.open(forked)
    try:
        assert rt.ledger.verify("acme").size == head.size + 2  # the signatures alone pass
        # ... and the witnesses refuse to cosign the rebuilt log.
        refused = TenantWitnesses(rt.store, rt.ledger).submit("acme")
    finally:
        rt.close()
    assert [(s.ok, s.status) for s in refused] == [(False, 422), (False, 422)], refused
    caught = run_cli("audit", "verify", "-t", "acme", *policy, "--witness-quorum", "1",
                     home=forked, check=False)  # fmt: skip
    assert caught.code == 3, caught.out + caught.err
    assert "does not extend the checkpoint witness witness.test/r1 last cosigned" in caught.err
    # Without asking, the stored cosignatures no longer verify on the re-signed checkpoints.
    offline = run_cli("audit", "verify", "-t", "acme", *policy, "--witness-quorum", "1",
                      "--witness-offline", home=forked, check=False)  # fmt: skip
    assert offline.code == 3 and "cosignature" in offline.err, offline.err
    assert w1.show()["logs"][0]["size"] == head.size  # type: ignore[index]
