"""Receipts and evidence packs carry what the tenant's witnesses cosigned, and the
auditor's commands hold them to a witness policy: on a copy of the demo's home,
with one witness (``proctor witness serve``) in a network namespace of its own."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import httpx
import pytest

from proctor.api import serve_api
from proctor.errors import VerificationFailed
from proctor.evidence import verify_pack_witnesses, verify_receipt
from proctor.governance import Runs
from proctor.ledger import Actor, Cosigner
from proctor.runtime import Runtime
from proctor.witness import TenantWitnesses
from tests.conftest import copy_home, logging_state, restore_logging, run_cli
from tests.integration.test_witness import (  # noqa: F401  (the fixture)
    Witnesses,
    check_cosignature,
    witnesses,
)

OP = Actor("operator", "test-operator")


def test_receipts_and_packs_carry_cosignatures_that_verify_demands(
    demo_home: Path,
    witnesses: Witnesses,  # noqa: F811
    tmp_path: Path,
) -> None:
    home = copy_home(demo_home, tmp_path / "home")
    rt = Runtime.open(home)
    try:
        vkey = rt.ledger.vkey()
        w = witnesses.new(tmp_path / "w", "witness.test/e1", [(rt.ledger.origin("acme"), vkey)])
        tw = TenantWitnesses(rt.store, rt.ledger)
        tw.use("acme", "e1", w.vkey, w.url, OP)
        assert [s.ok for s in tw.submit("acme")] == [True]
        size = rt.ledger.head("acme").size
        # The served checkpoint (the public tlog-tiles path) carries the cosignature.
        logs = logging_state()  # an API server in this process sets uvicorn's loggers up
        server = serve_api(rt, "127.0.0.1", 0, public_logs=("acme",))
        try:
            served = httpx.get(server.url + "/tenants/acme/log/checkpoint", timeout=30).text
        finally:
            server.stop()
            restore_logging(logs)
        text_part, _, sigs = served.rpartition("\n\n")
        # The log's signature(s), then the witness's.
        check_cosignature(sigs.rstrip("\n").split("\n")[-1], text_part + "\n", w.vkey)
        run = next(r for r in Runs(rt.store).all("acme") if r.environment == "production")
    finally:
        rt.close()
    other = Cosigner.generate("witness.test/e1").verifier.vkey()  # same name, another key

    # The receipt is made again against the cosigned checkpoint, and carries it.
    receipt = tmp_path / "run.tlog-proof"
    run_cli("receipt", "get", run.id, "-t", "acme", "-o", str(receipt), home=home)
    text = receipt.read_text()
    note = text.partition("\n\n")[2]
    cosig = note.rstrip("\n").rsplit("\n", 1)[1]
    check_cosignature(cosig, note.rpartition("\n\n")[0] + "\n", w.vkey)
    ok = run_cli("receipt", "verify", str(receipt), "--key", vkey, "--witness", w.vkey, "--json",
                 home=home)  # fmt: skip
    assert json.loads(ok.out)["size"] == size
    with pytest.raises(VerificationFailed, match="cosignature"):
        verify_receipt(text, vkey, [other], 1)
    # A cosignature line moved onto the receipt of another checkpoint does not verify.
    stale = run_cli("receipt", "verify", str(receipt), "--key", vkey, "--witness", other,
                    home=home, check=False)  # fmt: skip
    assert stale.code == 3 and "cosignature" in stale.err

    # The pack: the witness status and the cosigned checkpoint, held to the policy.
    pack = tmp_path / "pack.zip"
    run_cli("evidence", "export", "-t", "acme", "--from", "2000-01-01", "--to", "2100-01-01",
            "-o", str(pack), home=home)  # fmt: skip
    with zipfile.ZipFile(pack) as zf:
        status = json.loads(zf.read("witness/status.json"))
    assert status["newest_cosigned_size"] == size and status["within_policy"] is True
    assert status["policy"] == {"quorum": 1, "max_age_seconds": 3600}
    assert 0 <= status["newest_cosigned_age_seconds"] < 3600
    checked = run_cli("evidence", "verify", str(pack), "--key", vkey, "--witness", w.vkey,
                      "--json", home=home)  # fmt: skip
    assert json.loads(checked.out)["witness"]["witnessed_size"] == size
    with pytest.raises(VerificationFailed, match="cosignature"):
        verify_pack_witnesses(pack, vkey, [other], 1)
