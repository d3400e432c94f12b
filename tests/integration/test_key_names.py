"""Key names that match each log's origin (C2SP tlog-checkpoint: the key name SHOULD
be the origin). One Ed25519 key signs each checkpoint under the log's origin and
under the runtime's name; `key show --tenant T` prints the origin's line. A home
whose checkpoints were signed before (the runtime's name only) still verifies, and
an altered signature is caught whichever line the verifier holds."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from proctor.errors import VerificationFailed
from proctor.ledger import Actor, EventDraft, Ledger, Verifier, open_checkpoint
from proctor.runtime import Runtime
from tests.conftest import run_cli


def _sig_lines(note: str) -> dict[str, bytes]:
    return {
        line.split(" ")[1]: base64.b64decode(line.split(" ")[2])
        for line in note.rpartition("\n\n")[2].splitlines()
    }


def test_checkpoints_carry_the_origin_name_and_older_homes_still_verify(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    actor = Actor("operator", "test")
    # The home as the code before per-origin names wrote it: the runtime's name only.
    with monkeypatch.context() as m:
        m.setattr(Ledger, "_sign", lambda self, cp: self._signer.sign_note(cp.body()))
        with Runtime.open(home) as rt:
            rt.tenants.create("acme", rt.operator)
            for i in range(3):
                rt.ledger.append("acme", EventDraft(actor, "test.old", f"o/{i}"))
            old_note = rt.ledger.head("acme").checkpoint
    assert list(_sig_lines(old_note)) == ["proctor.local"]
    # Now, on the same home: each new checkpoint is signed under both names.
    with Runtime.open(home) as rt:
        for i in range(3):
            rt.ledger.append("acme", EventDraft(actor, "test.new", f"n/{i}"))
        head = rt.ledger.head("acme")
        origin = rt.ledger.origin("acme")
    assert origin == "proctor.local/tenant/acme"
    sigs = _sig_lines(head.checkpoint)
    assert list(sigs) == [origin, "proctor.local"]

    runtime_line = run_cli("key", "show", home=home).out.strip()
    origin_line = run_cli("key", "show", "--tenant", "acme", home=home).out.strip()
    shown = json.loads(run_cli("key", "show", "--tenant", "acme", "--json", home=home).out)
    assert shown == {"vkey": origin_line, "tenant": "acme", "origin": origin}
    name, key_id, b64 = origin_line.split("+", 2)
    raw = base64.b64decode(b64)
    assert name == origin and runtime_line.split("+", 2)[2] == b64  # one key, two names
    # The origin's line checked with nothing of Proctor's note code: key id and signature.
    assert bytes.fromhex(key_id) == hashlib.sha256(origin.encode() + b"\n" + raw).digest()[:4]
    assert sigs[origin][:4].hex() == key_id
    body = head.checkpoint.rpartition("\n\n")[0] + "\n"
    Ed25519PublicKey.from_public_bytes(raw[1:]).verify(sigs[origin][4:], body.encode())

    # Everything that verified before still does: the store, and an export with the
    # runtime's line (older checkpoints carry only that name).
    assert "verified proctor.local/tenant/acme" in run_cli("audit", "verify", "--tenant", "acme",
                                                           home=home).out  # fmt: skip
    out = tmp_path / "export"
    run_cli("audit", "export", "--tenant", "acme", "--out", str(out), home=home)
    run_cli("audit", "verify", "--from-export", str(out), "--key", runtime_line)
    # The origin's line opens every checkpoint signed since, not the older ones.
    assert open_checkpoint(head.checkpoint, Verifier.parse(origin_line), origin).size == head.size
    with pytest.raises(VerificationFailed, match="no signature by"):
        open_checkpoint(old_note, Verifier.parse(origin_line), origin)
    assert open_checkpoint(old_note, Verifier.parse(runtime_line), origin).size == head.size - 3

    # An altered signature under either name is refused, whichever line one holds.
    for altered in (origin, "proctor.local"):
        lines = []
        for line in head.checkpoint.rpartition("\n\n")[2].splitlines():
            if line.split(" ")[1] == altered:
                sig = bytearray(base64.b64decode(line.split(" ")[2]))
                sig[-1] ^= 1
                line = f"\u2014 {altered} {base64.b64encode(bytes(sig)).decode()}"
            lines.append(line + "\n")
        forged = f"{body}\n{''.join(lines)}"
        for holder in (runtime_line, origin_line):
            with pytest.raises(VerificationFailed, match="not valid"):
                open_checkpoint(forged, Verifier.parse(holder), origin)
    res = run_cli("key", "show", "--tenant", "globex", home=home, check=False)
    assert res.code != 0 and "unknown tenant" in res.err + res.out
