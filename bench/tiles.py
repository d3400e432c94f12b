"""The static tlog-tiles export and per-origin signing: figures.

* ``audit export`` of a log appended in large batches (few checkpoints) and of one
  appended one event at a time (a checkpoint per event: the most partial tiles and
  bundles the export can have): time, files and bytes of the tree against the
  events' own bytes; ``verify_export`` time.
* Signing a checkpoint under the origin and the runtime's name against one name.

Run with ``python bench/tiles.py [--events N] [--single M]``; real SQLite files
(WAL, synchronous=FULL).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from proctor.ledger import Actor, Checkpoint, EventDraft, Ledger, Signer, verify_export
from proctor.store import open_store

ACTOR = Actor("operator", "bench")


def draft(i: int) -> EventDraft:
    return EventDraft(ACTOR, "bench.event", f"item/{i}", details={"i": i, "pad": "x" * 400})


def tree_figures(out: Path) -> tuple[int, int, int]:
    events = (out / "events.jsonl").stat().st_size
    files = [p for p in (out / "tile").rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files), events


def run(dirpath: Path, name: str, events: int, single: bool) -> None:
    store = open_store(f"sqlite:///{dirpath / name}.db", create=True)
    ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
    ledger.create_log("acme", draft(0))
    if single:
        for i in range(1, events):
            ledger.append("acme", draft(i))
    else:
        ledger.append_many("acme", [draft(i) for i in range(1, events)])
    checkpoints = len(ledger.checkpoints("acme"))
    out = dirpath / f"{name}-export"
    t = time.perf_counter()
    ledger.export("acme", out)
    exported = time.perf_counter() - t
    t = time.perf_counter()
    verify_export(out)
    verified = time.perf_counter() - t
    files, tree, raw = tree_figures(out)
    print(
        f"{name}: {events} events, {checkpoints} checkpoints; export {exported:.2f} s, "
        f"verify_export {verified:.2f} s; tree {files} files, {tree / 1e6:.1f} MB "
        f"({tree / raw:.1f}x the events' {raw / 1e6:.1f} MB)"
    )
    ledger.close()
    store.close()


def signing(n: int = 2000) -> None:
    signer = Signer.generate("bench.local")
    origin = signer.named("bench.local/tenant/acme")
    body = Checkpoint("bench.local/tenant/acme", 12345, b"\1" * 32).body()
    t = time.perf_counter()
    for _ in range(n):
        signer.sign_note(body)
    one = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        origin.sign_note(body, signer)
    two = (time.perf_counter() - t) / n
    print(
        f"signing a checkpoint: one name {one * 1e6:.0f} us, "
        f"origin + runtime name {two * 1e6:.0f} us"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=20_000, help="events appended in one batch")
    ap.add_argument("--single", type=int, default=1_000, help="events appended one at a time")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        run(Path(d), "batched", args.events, single=False)
        run(Path(d), "one-by-one", args.single, single=True)
    signing()


if __name__ == "__main__":
    main()
