"""An evidence pack after pruning and an erasure (issue 20): it verifies, it shows
the rule, the holds and the record of prunes and erasures, its report maps the
controls, and it holds no value from which an erased key's hash can be recomputed.
The control mapping's every check names a function that exists."""

from __future__ import annotations

import importlib
import json
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proctor.evidence import export_pack, verify_pack
from proctor.evidence._retention import CHECKS, RETENTION_CONTROLS
from proctor.governance import Retention, erase_key, record_key_hmac, unbacked_erasures
from proctor.ledger import Actor, EventDraft, lineage_object, lineage_seqs
from proctor.lifecycle._serve import prune_all
from tests.e2e.conftest_gov import build_gov
from tests.integration.test_erasure import derivable
from tests.integration.test_retention import add_run


def test_every_control_names_checks_that_exist() -> None:
    ids = {cid for cid, *_ in RETENTION_CONTROLS}
    wanted = {"EUAIA-12", "EUAIA-19", "EUAIA-26.6", "SOC2-CC6", "SOC2-CC7", "ISO27001-A.8.15",
              "ISO27001-A.8.16", "NIST-AU-2", "NIST-AU-9.3", "NIST-AU-10", "NIST-AU-11",
              "GDPR-5.1.e", "GDPR-17", "GDPR-28", "GDPR-30", "GDPR-32"}  # fmt: skip
    assert wanted <= ids
    for cid, title, evidence, checks, operator in RETENTION_CONTROLS:
        assert title and evidence and operator and checks, cid
        for check in checks:
            module, _, name = CHECKS[check].partition(":")
            obj: object = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part)
            assert callable(obj), (cid, check)


def test_a_pack_after_pruning_and_erasure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gov = build_gov(tmp_path)
    rt, op = gov.rt, gov.op
    lkey = rt.keys.lineage_key("acme")
    for i, run in enumerate(["run-old", "run-held", "run-old2"]):
        obj, ref = lineage_object(record_key_hmac(lkey, str(k)) for k in range(i, i + 10))
        rt.ledger.append("acme", EventDraft(
            Actor("workload", run), "test.read", "table/customers", run=run, objects=(obj,),
            details={"dataset": "crm", "lineage_object": ref}))  # fmt: skip
    ret = Retention(rt.store, rt.ledger)
    ret.set("acme", 200, op)
    add_run(rt.store, "run-held")  # a hold names a run that exists
    ret.add_hold("acme", "run", "run-held", "case 9", op)
    # A year later (the ledger's clock moves on; event times never go back).
    later = datetime.now(UTC) + timedelta(days=365)
    monkeypatch.setattr(rt.ledger, "_clock", lambda: later.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
    # What proctor serve does at start and every six hours, for every tenant.
    prune_all(rt, Actor("runtime", "supervisor:test"))
    prunes = [e for e in ret.history("acme") if e["action"] == "retention.prune"]
    assert len(prunes) == 1 and prunes[0]["details"]["held"] == 1
    pruned_count = prunes[0]["details"]["count"]
    assert pruned_count >= 2
    # The pruned reads' index rows went with them; the held run's stayed.
    assert lineage_seqs(rt.store, "acme", record_key_hmac(lkey, "0")) == set()
    assert len(lineage_seqs(rt.store, "acme", record_key_hmac(lkey, "10"))) == 1
    erased = record_key_hmac(lkey, "5")
    # Key 5 was read by run-held too (keys 1..10): its object still holds it until erased.
    done = erase_key(rt.store, rt.ledger, "acme", "crm", erased, "DSR-77", op)
    assert done.objects == 1
    pack = tmp_path / "pack.zip"
    export_pack(rt, "acme", "2000-01-01T00:00:00.000000Z", "2100-01-01T00:00:00.000000Z", pack)
    report = verify_pack(pack)
    assert report.events == rt.ledger.head("acme").size
    # The erased object is held to the erasure's list, which the pack carries; in the
    # store, the pruned reads' index rows are gone with them, the held one's kept.
    assert (report.erasures, report.erasures_uncommitted) == (1, 0)
    assert unbacked_erasures(rt.store, "acme") == []
    with zipfile.ZipFile(pack) as zf:
        record = json.loads(zf.read("governance/retention.json"))
        md = zf.read("report/report.md").decode()
        html = zf.read("report/report.html").decode()
        everything = b"".join(zf.read(n) for n in zf.namelist())
    assert record["rule"]["days"] == 200 and record["pruned"] == pruned_count
    assert [h["target"] for h in record["holds"]] == ["run-held"]
    assert record["erasures"] == ["DSR-77"]
    assert [e["action"] for e in record["history"]] == [
        "retention.set", "hold.add", "retention.prune", "erasure.request"]  # fmt: skip
    assert record["history"][-1]["details"]["entries"]["count"] == 1
    for _, title, *_ in RETENTION_CONTROLS:
        assert title in md and title in html
    assert "retention/200d" in md
    assert erased.encode() not in everything and bytes.fromhex(erased) not in everything
    # Nor its leaf, salted with any salt the pack or the store still holds.
    with rt.store.read() as conn:
        stored = [bytes(r[0]) for r in conn.query("SELECT data FROM ledger_objects")]
    with zipfile.ZipFile(pack) as zf:
        stored += [zf.read(n) for n in zf.namelist() if n.startswith("lineage/")]
    for value in derivable(erased, stored):
        assert value not in everything
    rt.close()
