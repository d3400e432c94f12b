"""C2SP signed notes: the Go reference vector, and refusal of every mangling."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from proctor.errors import UsageError, VerificationFailed
from proctor.ledger import Checkpoint, Signer, Verifier, open_checkpoint
from proctor.ledger._note import open_note

# golang.org/x/mod/sumdb/note's documented example key and note.
GO_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_SKEY_B64 = "AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_TEXT = (
    "If you think cryptography is the answer to your problem,\n"
    "then you don't know what your problem is.\n"
)
GO_SIG = (
    "— PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfq"
    "dngotpRZb6KE6RyyBwJnAM=\n"
)


def go_signer() -> Signer:
    seed = base64.b64decode(GO_SKEY_B64)[1:]
    return Signer("PeterNeumann", Ed25519PrivateKey.from_private_bytes(seed))


def test_matches_go_reference_byte_for_byte() -> None:
    signer = go_signer()
    assert signer.verifier.vkey() == GO_VKEY
    assert signer.sign_note(GO_TEXT) == GO_TEXT + "\n" + GO_SIG
    assert open_note(GO_TEXT + "\n" + GO_SIG, Verifier.parse(GO_VKEY)) == GO_TEXT


@pytest.mark.parametrize(
    "vkey",
    [
        GO_VKEY.replace("c74f20a3", "c74f20a4"),
        GO_VKEY.replace("PeterNeumann", "PeterNeumanm"),
        GO_VKEY + "A",
        GO_VKEY.replace("+ARpc", "+AhRpc"),
        "PeterNeumann+c74f20a3",
        "Peter Neumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
    ],
)
def test_mangled_verifier_keys_are_refused(vkey: str) -> None:
    with pytest.raises(UsageError):
        Verifier.parse(vkey)


def test_checkpoint_round_trip_and_tampering() -> None:
    signer = Signer.generate("proctor.example")
    cp = Checkpoint("proctor.example/tenant/acme", 42, bytes(range(32)))
    note = signer.sign_note(cp.body())
    assert open_checkpoint(note, signer.verifier, cp.origin) == cp
    # Any change to the body breaks the signature.
    for bad in (note.replace("\n42\n", "\n43\n"), note.replace("acme", "acmf")):
        with pytest.raises(VerificationFailed):
            open_checkpoint(bad, signer.verifier)
    with pytest.raises(VerificationFailed, match="expected"):
        open_checkpoint(note, signer.verifier, "proctor.example/tenant/other")
    other = Signer.generate("proctor.example")
    with pytest.raises(VerificationFailed, match="no signature"):
        open_checkpoint(note, other.verifier)
    with pytest.raises(VerificationFailed):
        open_checkpoint(cp.body(), signer.verifier)


def test_verifier_keys_whose_base64_holds_plus_signs_parse() -> None:
    """Found by the CLI tests: base64 may contain '+', the field separator."""
    seen = 0
    for _ in range(200):
        signer = Signer.generate("proctor.local")
        vkey = signer.verifier.vkey()
        if vkey.count("+") > 2:
            seen += 1
            assert Verifier.parse(vkey).public == signer.verifier.public
    assert seen > 0
