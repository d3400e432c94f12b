"""Witnesses: figures.

* ``add-checkpoint`` against a real witness (``WitnessServer`` on loopback, its
  SQLite state with synchronous=FULL): requests per second and latency for a log
  that grows by a few events between submissions (a consistency proof each time).
* A submitter pass (``TenantWitnesses.submit``: read the head, make the proof, post,
  verify and store the cosignature) for one witness.
* Appends to the log while a witness is unreachable: the submitter is not on their
  path, so the append rate should not move.

Run with ``python bench/witness.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.store import open_store
from proctor.witness import (
    Submitter,
    TenantWitnesses,
    Witness,
    WitnessServer,
    add_checkpoint_body,
)

ACTOR = Actor("operator", "bench")


def draft(i: int) -> EventDraft:
    return EventDraft(ACTOR, "bench.event", f"item/{i}", details={"i": i})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        store = open_store(f"sqlite:///{d / 'log.db'}", create=True)
        ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
        ledger.create_log("acme", draft(0))
        witness = Witness.init(d / "w", "bench.local/w1")
        witness.add_log(ledger.origin("acme"), ledger.vkey())
        server = WitnessServer(witness, "127.0.0.1", 0)
        server.start()
        url = "http://{}:{}".format(*server.address)

        # add-checkpoint, the protocol alone.
        old, lat = 0, []
        with httpx.Client(timeout=10) as http:
            for i in range(args.rounds):
                ledger.append_many("acme", [draft(i * 4 + k) for k in range(4)])
                head = ledger.head("acme")
                proof = list(ledger.consistency_proof("acme", old, head.size).hashes) if old else []
                body = add_checkpoint_body(old, proof, head.checkpoint)
                t = time.perf_counter()
                r = http.post(url + "/add-checkpoint", content=body)
                lat.append(time.perf_counter() - t)
                assert r.status_code == 200, r.text
                old = head.size
        lat.sort()
        print(
            f"add-checkpoint: {args.rounds} requests, median {statistics.median(lat) * 1e3:.1f} ms,"
            f" p95 {lat[int(len(lat) * 0.95)] * 1e3:.1f} ms, {len(lat) / sum(lat):.0f}/s serial"
        )

        # A submitter pass, through the runtime's tables.
        from proctor.store import Conn

        def tenant(conn: Conn) -> None:
            conn.execute(
                "INSERT INTO tenants (name, created_at, created_by) VALUES ('acme', '', 'bench')"
            )

        with store.write() as conn:
            tenant(conn)
        tw = TenantWitnesses(store, ledger)
        tw.use("acme", "w1", witness.vkey, url, ACTOR)
        passes = []
        with httpx.Client(timeout=10) as http:
            for i in range(50):
                ledger.append("acme", draft(10**6 + i))
                t = time.perf_counter()
                done = tw.submit("acme", http)
                passes.append(time.perf_counter() - t)
                assert done[0].ok, done
        print(f"submitter pass (1 witness): median {statistics.median(passes) * 1e3:.1f} ms")
        server.stop()

        # Appends with the witness gone and the submitter trying every 50 ms.
        logging.getLogger("proctor.witness").setLevel(logging.ERROR)  # a warning a pass
        sub = Submitter(tw, interval=0.05)
        for label in ("submitter off", "witness down, submitter on"):
            if label.startswith("witness"):
                sub.start()
            n, t = 0, time.perf_counter()
            while time.perf_counter() - t < 2.0:
                ledger.append("acme", draft(2 * 10**6 + n))
                n += 1
            print(f"appends, {label}: {n / (time.perf_counter() - t):.0f}/s")
        sub.stop()
        ledger.close()
        store.close()


if __name__ == "__main__":
    main()
