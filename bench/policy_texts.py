"""What carrying and checking the policy texts costs an evidence pack.

``python bench/policy_texts.py [--events N]`` (default 100,000). Builds a real
home whose production run stores its effective policy set with ``run.start`` (as
the supervisor does) and whose N broker events cite its version (SQL allowed,
egress allowed and refused, each with the request it was decided on); exports the
pack, then times ``verify_pack`` and, alone, the policy step it adds (``PolicyScan``:
gathering the cited versions and the sample in verify's one pass over the events,
every cited text hashed, up to 200 decisions decided again).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from proctor.evidence import export_pack, verify_pack
from proctor.evidence._policies import PolicyScan
from proctor.governance import (
    capabilities_hash,
    effective_policies,
    environment_forbid,
    policy_object,
)
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
RUN: dict[str, Any] = {
    "deployment": "churn",
    "run": "r-0001",
    "artifact": DIGEST,
    "approvals": ("apr_1",),
}
ALL = ("2000-01-01T00:00:00.000000Z", "2100-01-01T00:00:00.000000Z")


def draft(i: int, version: str) -> EventDraft:
    kind = i % 10
    http = {"port": 443, "method": "GET", "scheme": "https", "policy_version": version}
    if kind == 9:
        return EventDraft(
            W,
            "http.request",
            "host/evil.example:443",
            decision="deny",
            policies=("tenant:subprocessors",),
            reason="forbidden by tenant:subprocessors",
            details={"host": "evil.example", **http},
            **RUN,
        )
    if kind in (7, 8):
        return EventDraft(
            W,
            "http.request",
            "host/api.example.com:443",
            policies=("deploy:churn:egress:api.example.com:443",),
            reason="permitted",
            details={"host": "api.example.com", **http},
            **RUN,
        )
    table = {
        "action": "sql.select",
        "table": "customers",
        "columns": ["country", "id", "plan"],
        "decision": "allow",
        "policies": ["deploy:churn:sql:crm.customers"],
    }
    return EventDraft(
        W,
        "sql.select",
        "dataset/crm/table/customers",
        policies=("deploy:churn:sql:crm.customers",),
        reason="permitted",
        details={"dataset": "crm", "policy_version": version, "tables": [table]},
        **RUN,
    )


def build(home: Path, events: int) -> None:
    init_home(home, "proctor.local")
    with Runtime.open(home) as rt:
        rt.tenants.create("acme", rt.operator)
        rt.subprocessors.add(
            "acme", "api", purpose="p", location="EU", hosts=["api.example.com"], actor=rt.operator
        )
        forbid = environment_forbid(rt.resources, rt.subprocessors, "acme", "production")
        compiled = effective_policies(rt.policies, "acme", "churn", CAPS, forbid)
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
                DEV,
                "run.start",
                "run/r-0001",
                details={"environment": "production", "policy_version": compiled.version},
                objects=(policy_object(compiled),),
                **RUN,
            ),
        )
        done = 0
        while done < events:
            k = min(20_000, events - done)
            rt.ledger.append_many("acme", [draft(done + i, compiled.version) for i in range(k)])
            done += k


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home, pack = Path(tmp) / "home", Path(tmp) / "pack.zip"
        build(home, args.events)
        with Runtime.open(home) as rt:
            t0 = time.perf_counter()
            export_pack(rt, "acme", *ALL, pack)
            print(f"export: {time.perf_counter() - t0:.2f} s")
            vkey = rt.ledger.vkey()
        t0 = time.perf_counter()
        report = verify_pack(pack, vkey)
        print(
            f"verify: {time.perf_counter() - t0:.2f} s ({report.decisions_redecided} decisions "
            f"decided again, {report.policy_versions} policy text)"
        )
        with zipfile.ZipFile(pack) as zf:
            lines = zf.read("events/events.jsonl").splitlines()
            parsed = [json.loads(x) for x in lines]
            t0 = time.perf_counter()
            scan = PolicyScan(len(lines))
            for i, (data, ev) in enumerate(zip(lines, parsed, strict=True)):
                scan.add(i, ev, data)
            gathered = time.perf_counter() - t0
            check = scan.check(zf, {"r-0001": {"details": {"environment": "production"}}})
            took = time.perf_counter() - t0
        print(
            f"policy step of verify: {took:.2f} s for {args.events:,} events ({gathered:.2f} s "
            f"gathering in verify's pass, {check.candidates:,} re-decidable, "
            f"{check.redecided} decided again)"
        )


if __name__ == "__main__":
    main()
