"""``limits.calls``: the most calls a run makes at the broker, in all (issue 31, item 5).

Like every limit it is part of the manifest an approver approves: it is in the
manifest's canonical form, so it changes the artifact's digest, and a stored
manifest keeps it. A value that is not a positive integer up to the maximum is
refused with one message naming the key.
"""

from __future__ import annotations

import pytest

from proctor.errors import UsageError
from proctor.governance._artifacts import artifact_digest
from proctor.governance._manifest import DEFAULT_CALLS, MAX_CALLS, Manifest, parse_manifest

HEAD = """
[artifact]
name = "churn-report"
entrypoint = ["python3", "main.py"]
purpose = "Monthly churn report for the retention team"
"""


def test_the_bound_is_in_what_is_approved() -> None:
    bare = parse_manifest(HEAD)
    bound = parse_manifest(HEAD + "[limits]\ncalls = 250\n")
    assert bare.limits.calls is None  # the runtime's default applies
    assert bound.limits.calls == 250
    assert bound.limits.to_json() == {"calls": 250}
    assert bound.to_json()["limits"] == {"calls": 250}
    # Another bound is another artifact: approvers approve the number.
    other = parse_manifest(HEAD + "[limits]\ncalls = 251\n")
    digests = {artifact_digest([], m) for m in (bare, bound, other)}
    assert len(digests) == 3
    # A stored manifest keeps it; one stored before the key existed still reads.
    assert Manifest.from_json(bound.to_json()).limits.calls == 250
    assert Manifest.from_json(bare.to_json()).limits.calls is None
    assert parse_manifest(HEAD + f"[limits]\ncalls = {MAX_CALLS}\n").limits.calls == MAX_CALLS
    assert 1 <= DEFAULT_CALLS <= MAX_CALLS


@pytest.mark.parametrize(
    "value", ["0", "-1", str(MAX_CALLS + 1), "2.5", "'many'", "true", "[5]", "1e3"]
)
def test_a_bound_that_is_not_a_positive_integer_up_to_the_maximum_is_refused(value: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_manifest(HEAD + f"[limits]\ncalls = {value}\n")
    message = info.value.diagnostics()
    assert f"limits.calls must be a positive integer up to {MAX_CALLS}" in message
    assert len(info.value.message.splitlines()) == 1
