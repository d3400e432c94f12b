"""Evidence figures: export and verify times of a pack of N events (default 1,000,000).

``python bench/evidence.py [--events N]``. Builds a real home (SQLite, WAL,
synchronous=FULL) whose tenant log holds a production run's realistic mix of
broker events (SQL with lineage hashes, egress decisions and closes, denials),
built fast with ``Ledger.append_many``; then times ``export_pack`` and
``verify_pack`` of the whole period.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from proctor.evidence import export_pack, verify_pack
from proctor.governance import capabilities_hash
from proctor.ledger import Actor, EventDraft
from proctor.runtime import Runtime, init_home

DIGEST = "sha256:" + "ab" * 32
CAPS = {
    "datasets": {
        "crm": {"tables": {"customers": {"columns": ["country", "id", "plan"], "access": "read"}}}
    },
    "egress": ["api.example.com:443"],
}
DEV, ALICE = Actor("user", "acme/dev"), Actor("user", "acme/alice")
W = Actor("workload", "spiffe://proctor.local/tenant/acme/deployment/churn/run/r-0001")
RUN = {"deployment": "churn", "run": "r-0001", "artifact": DIGEST, "approvals": ("apr_1",)}


def draft(i: int) -> EventDraft:
    kind = i % 10
    if kind == 9:
        return EventDraft(
            W,
            "http.request",
            "host/evil.example:443",
            decision="deny",
            reason="denied: no policy permits it",
            details={"host": "evil.example", "port": 443, "method": "GET"},
            **RUN,
        )  # type: ignore[arg-type]
    if kind in (7, 8):
        return EventDraft(
            W,
            "http.request",
            "host/api.example.com:443",
            policies=("deploy:churn:egress:api.example.com:443",),
            reason="permitted",
            details={"host": "api.example.com", "port": 443, "method": "POST", "path": "/v1"},
            **RUN,
        )  # type: ignore[arg-type]
    return EventDraft(
        W,
        "sql.select",
        "dataset/crm/table/customers",
        policies=("deploy:churn:sql:crm.customers",),
        reason="permitted",
        details={
            "dataset": "crm",
            "lineage": "rows",
            "row_count": 2,
            "keys_hmac": [f"{i:032x}", f"{i + 1:032x}"],
            "tables": [
                {"action": "sql.select", "table": "customers", "columns": ["country", "id", "plan"]}
            ],
        },
        **RUN,
    )  # type: ignore[arg-type]


def build(home: Path, events: int) -> None:
    init_home(home, "proctor.local")
    with Runtime.open(home) as rt:
        rt.tenants.create("acme", rt.operator)
        ch = capabilities_hash(CAPS)
        rt.ledger.append(
            "acme",
            EventDraft(
                DEV,
                "artifact.submit",
                f"artifact/{DIGEST}",
                artifact=DIGEST,
                details={"capabilities": CAPS, "capabilities_hash": ch},
            ),
        )
        rt.ledger.append(
            "acme",
            EventDraft(
                ALICE,
                "approval.grant",
                f"artifact/{DIGEST}",
                artifact=DIGEST,
                approvals=("apr_1",),
                details={"approval": "apr_1", "capabilities_hash": ch},
            ),
        )
        rt.ledger.append(
            "acme",
            EventDraft(
                DEV, "run.start", "run/r-0001", details={"environment": "production"}, **RUN
            ),
        )  # type: ignore[arg-type]
        done, t0 = 0, time.perf_counter()
        while done < events:
            k = min(20_000, events - done)
            rt.ledger.append_many("acme", [draft(done + i) for i in range(k)])
            done += k
        print(f"built {events:,} events in {time.perf_counter() - t0:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        home = Path(tmp) / "home"
        build(home, args.events)
        pack = Path(tmp) / "pack.zip"
        with Runtime.open(home) as rt:
            t0 = time.perf_counter()
            info = export_pack(
                rt, "acme", "2000-01-01T00:00:00.000000Z", "2100-01-01T00:00:00.000000Z", pack
            )
            export_s = time.perf_counter() - t0
            vkey = rt.ledger.vkey()
        t0 = time.perf_counter()
        report = verify_pack(pack, vkey)
        verify_s = time.perf_counter() - t0
        size = pack.stat().st_size
        print(
            f"export: {info.events:,} events in {export_s:.1f} s "
            f"({info.events / export_s:,.0f} events/s); pack {size / 1e6:.0f} MB"
        )
        print(
            f"verify: {report.events:,} events in {verify_s:.1f} s "
            f"({report.events / verify_s:,.0f} events/s); "
            f"{report.accesses_checked:,} accesses checked against capabilities"
        )


if __name__ == "__main__":
    main()
