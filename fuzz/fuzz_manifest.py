"""``proctor.toml``: a Manifest usable everywhere it goes next, or a ProctorError."""

from __future__ import annotations

import _harness

_harness.instrumented("proctor.governance._manifest", "proctor.policy._capabilities")

from tests.fuzz._oracle_manifest import check_manifest  # noqa: E402

SEEDS = [
    (_harness.ROOT / "examples" / "churn-report" / "proctor.toml").read_bytes(),
    b'[artifact]\nname = "a"\nentrypoint = ["sh", "-c", "x"]\npurpose = "p"\n'
    b'[lifecycle]\nmode = "schedule"\nevery = "1h"\n[limits]\nmemory = "1G"\npids = 8\n',
]


if __name__ == "__main__":
    _harness.run(check_manifest, SEEDS)
