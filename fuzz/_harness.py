"""What every atheris harness shares: the repository on the path, the target's
modules instrumented for coverage, and seeds written into an empty corpus.

Run one harness as ``python fuzz/fuzz_<name>.py -max_total_time=60 <corpus dir>``
(``scripts/fuzz.sh`` runs them all for ``make soak``). A property that breaks is an
AssertionError from the oracle the hypothesis tests use (``tests/fuzz/_oracle_*``),
which libFuzzer reports as a crash with the input that caused it.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import atheris  # noqa: E402


def instrumented(*modules: str) -> None:
    """Import ``modules`` with coverage instrumentation (before anything else does)."""
    with atheris.instrument_imports(include=["proctor"]):
        for name in modules:
            __import__(name)


def run(test_one_input: Callable[[bytes], None], seeds: Iterable[bytes]) -> None:
    corpus = [Path(a) for a in sys.argv[1:] if not a.startswith("-")]
    # A file argument replays one input (a crash); a directory is the corpus.
    if corpus and not corpus[0].is_file():
        where = corpus[0]
        where.mkdir(parents=True, exist_ok=True)
        if not any(where.iterdir()):
            for seed in seeds:
                (where / hashlib.sha1(seed).hexdigest()).write_bytes(seed)  # noqa: S324
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
