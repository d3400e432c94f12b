"""The oracle for ``proctor.toml`` (``parse_manifest``), shared by the hypothesis test and
the atheris harness: a Manifest, or a ProctorError with a message for people; and an
accepted manifest must be usable everywhere it goes next (digest, store round trip,
the deployment's Cedar permits, the sandbox's limits)."""

from __future__ import annotations

import json

from proctor.errors import ProctorError
from proctor.governance import Manifest, parse_manifest
from proctor.ledger import canonical_json
from proctor.policy import capability_policies, compile_policies
from proctor.sandbox import Limits


def check_manifest(source: bytes | str, *, compile_permits: bool = True) -> Manifest | None:
    try:
        manifest = parse_manifest(source)
    except ProctorError as exc:
        assert isinstance(exc.message, str) and exc.message.strip(), repr(exc)
        return None
    # What submit does next: the canonical bytes the digest covers...
    stored = canonical_json(manifest.to_json())
    # ...what the store gives back later...
    again = Manifest.from_json(json.loads(stored))
    assert again == manifest, (again, manifest)
    assert again.capabilities_hash == manifest.capabilities_hash
    assert canonical_json(again.to_json()) == stored
    # ...the permits an approval turns it into, and the limits a run gets.
    if compile_permits:
        compile_policies(capability_policies("acme", "churn", manifest.capabilities))
    Limits(**manifest.limits.to_json())
    assert parse_manifest(source) == manifest, "parsing is not deterministic"
    return manifest
