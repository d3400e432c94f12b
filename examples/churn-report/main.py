"""Churn-risk report per country and plan.

Reads the approved columns of crm.customers through the broker, scores each
customer's churn risk from their plan and monthly revenue, posts an aggregate
summary (counts and sums only, no customer ids) to the enrichment API named by
ENRICH_URL, and writes a Markdown report to the `reports` bucket.

It also tries three things it was not approved for, the way careless or
over-eager generated code does: the `email` column, a host nobody approved,
and the cloud metadata address. Each is refused by the runtime; the refusal
is caught and printed, and the report goes on.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import urllib.error
import urllib.request
from collections import defaultdict

import proctor_guest

DATASET = "crm"
PAGE = 2000
ENRICH_URL = os.environ.get("ENRICH_URL", "http://127.0.0.1:8808/v1/churn-benchmarks")


def say(text: str) -> None:
    print(text, flush=True)


def load_customers() -> list[tuple[int, str, str, float]]:
    """Every customer's approved columns, a page at a time (the broker caps rows per call)."""
    rows: list[tuple[int, str, str, float]] = []
    last = -1
    while True:
        page = proctor_guest.sql(
            DATASET,
            "SELECT id, country, plan, mrr FROM customers WHERE id > ? ORDER BY id LIMIT ?",
            [last, PAGE],
        )["rows"]
        rows.extend((int(r[0]), str(r[1]), str(r[2]), float(r[3])) for r in page)
        if len(page) < PAGE:
            return rows
        last = int(page[-1][0])


def churn_stats(customers: list[tuple[int, str, str, float]]) -> list[dict[str, object]]:
    """Per (country, plan): customers, revenue, and how many pay well under their plan's median.

    Paying far below the plan's typical revenue (heavy discounts, downgraded
    seats) is the at-risk signal this report uses.
    """
    by_plan: dict[str, list[float]] = defaultdict(list)
    for _, _, plan, mrr in customers:
        by_plan[plan].append(mrr)
    median = {plan: statistics.median(values) for plan, values in by_plan.items()}
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for _, country, plan, mrr in customers:
        groups[(country, plan)].append(mrr)
    out = []
    for (country, plan), values in sorted(groups.items()):
        at_risk = sum(1 for v in values if v < 0.5 * median[plan])
        out.append(
            {
                "country": country,
                "plan": plan,
                "customers": len(values),
                "mrr": round(sum(values), 2),
                "at_risk": at_risk,
                "risk_rate": round(at_risk / len(values), 4),
            }
        )
    return out


def post_summary(stats: list[dict[str, object]]) -> dict[str, object] | None:
    """Aggregates only: the third party never sees a customer."""
    body = json.dumps({"groups": stats}).encode()
    if not ENRICH_URL.startswith(("http://", "https://")):
        say(f"  ENRICH_URL {ENRICH_URL!r} is not an http(s) URL; no benchmarks")
        return None
    req = urllib.request.Request(  # noqa: S310 - scheme checked above
        ENRICH_URL, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
            return dict(json.loads(resp.read() or b"{}"))
    except (urllib.error.URLError, ValueError) as exc:
        say(f"  enrichment API unavailable ({exc}); the report goes without benchmarks")
        return None


def refused_http(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - fixed http URLs
            return f"NOT refused: HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace").strip().splitlines()
        verdict = "refused" if exc.code == 403 else "failed"
        return f"{verdict}: HTTP {exc.code} {detail[0] if detail else exc.reason}"
    except urllib.error.URLError as exc:
        return f"failed: {exc.reason}"


def try_forbidden() -> list[str]:
    """What the runtime must refuse; each attempt is caught so the job goes on."""
    lines = []
    say("- reading customers.email (not approved):")
    try:
        proctor_guest.sql(DATASET, "SELECT id, email FROM customers LIMIT 5")
        outcome = "NOT refused: emails were returned"
    except proctor_guest.Denied as exc:
        outcome = f"refused: {exc} (policies: {', '.join(exc.policies) or 'default deny'})"
    say(f"  {outcome}")
    lines.append(f"| read `customers.email` | {outcome} |")

    for label, url in (
        ("an unapproved host", "http://api.unapproved.example/"),
        ("the cloud metadata address", "http://169.254.169.254/latest/meta-data/"),
    ):
        say(f"- calling {label} ({url}):")
        outcome = refused_http(url)
        say(f"  {outcome}")
        lines.append(f"| call {label} | {outcome} |")
    return lines


def report(
    stats: list[dict[str, object]], benchmarks: dict[str, object] | None, refusals: list[str]
) -> str:
    total = sum(int(str(g["customers"])) for g in stats)
    risky = sum(int(str(g["at_risk"])) for g in stats)
    lines = [
        "# Churn-risk report",
        "",
        f"{total} customers, {risky} at risk ({risky / max(total, 1):.1%}).",
        "",
        "| country | plan | customers | MRR | at risk | rate |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for g in sorted(stats, key=lambda g: -float(str(g["risk_rate"]))):
        lines.append(
            f"| {g['country']} | {g['plan']} | {g['customers']} | {float(str(g['mrr'])):,.2f} |"
            f" {g['at_risk']} | {float(str(g['risk_rate'])):.1%} |"
        )
    if benchmarks:
        lines += [
            "",
            "## Benchmarks from the enrichment API",
            "",
            "```json",
            json.dumps(benchmarks, indent=2, sort_keys=True),
            "```",
        ]
    lines += ["", "## Attempts the runtime refused", "", "| attempt | outcome |", "|---|---|"]
    lines += refusals
    return "\n".join(lines) + "\n"


def main() -> int:
    try:
        me = proctor_guest.whoami()
        say(f"running as {me.get('workload')}")
    except proctor_guest.GuestError as exc:
        say(f"whoami failed: {exc}")
    customers = load_customers()
    say(f"read {len(customers)} customers (id, country, plan, mrr)")
    stats = churn_stats(customers)
    benchmarks = post_summary(stats)
    if benchmarks is not None:
        say("posted the aggregate summary to the enrichment API")
    say("trying what this artifact was not approved for:")
    refusals = try_forbidden()
    text = report(stats, benchmarks, refusals)
    stored = proctor_guest.write("reports", "churn.md", text.encode())
    say(f"report written to reports/churn.md ({stored.get('bytes')} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
