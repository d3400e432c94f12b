"""A decision says why, in the words every refusal and record of the broker uses."""

from __future__ import annotations

import pytest

from proctor.policy import Decision


@pytest.mark.parametrize(
    ("decision", "why", "reason"),
    [
        (Decision(True, ("a", "b"), "v"), "permitted by a, b", "permitted by a, b"),
        (Decision(False, ("f",), "v"), "forbidden by f", "forbidden by f"),
        (Decision(False, (), "v"), "no policy permits it", "denied: no policy permits it"),
        # A policy that failed to evaluate is named, but it forbade nothing.
        (
            Decision(False, ("p",), "v", ("error in p",)),
            "policy evaluation failed",
            "denied: policy evaluation failed",
        ),
        (
            Decision(False, (), "v", ("TypeError: x",)),
            "policy evaluation failed",
            "denied: policy evaluation failed",
        ),
    ],
)
def test_a_decision_carries_its_reason(decision: Decision, why: str, reason: str) -> None:
    assert decision.why == why
    assert decision.reason == reason
