"""Policy decisions per second and latency: parse once vs parse every time.

A realistic tenant: 20 deployments, each with the permits its approved
capabilities give (5 tables, 5 egress entries, 3 secrets, 2 buckets), plus
tenant-wide forbids. The requests are the broker's mix: allowed and denied
SQL, allowed and denied HTTP (exact host and wildcard), secrets and files.

    .venv/bin/python bench/policy.py [--seconds 2] [--write-docs]

``--write-docs`` replaces the figures between the bench markers in
docs/policy.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cedarpy

from proctor.policy import (
    CedarValue,
    Decision,
    Entity,
    EntityRef,
    EntitySet,
    Request,
    capability_policies,
    compile_policies,
    decide,
)

TENANT = "acme"
DEPLOYMENTS = 20
MARK_BEGIN = "<!-- bench/policy.py: begin -->"
MARK_END = "<!-- bench/policy.py: end -->"

TENANT_FORBIDS = """
@id("tenant:no-email")
forbid (principal, action == Proctor::Action::"sql.select", resource)
when { context.columns.contains("email") };

@id("tenant:no-metadata")
forbid (principal, action == Proctor::Action::"http.request", resource)
when { context has address && context.address.isInRange(ip("169.254.0.0/16")) };

@id("tenant:big-uploads")
forbid (principal, action == Proctor::Action::"file.write", resource)
when { context has bytes && context.bytes > 104857600 };
"""


def capabilities(i: int) -> dict[str, object]:
    return {
        "datasets": {
            f"ds{i}": {
                "tables": {
                    f"t{j}": {"columns": ["id", "country", "plan", "revenue"], "access": "read"}
                    for j in range(5)
                }
            }
        },
        "egress": [f"api{j}.svc{i}.example.com:443" for j in range(4)] + [f"*.cdn{i}.example.org"],
        "secrets": [f"token{j}" for j in range(3)],
        "buckets": {"reports": "write", "inputs": "read"},
    }


def policy_text() -> str:
    parts = [capability_policies(TENANT, f"dep{i}", capabilities(i)) for i in range(DEPLOYMENTS)]
    return "\n".join([*parts, TENANT_FORBIDS])


def workload(i: int) -> str:
    return f"spiffe://proctor.bench/tenant/{TENANT}/deployment/dep{i}/run/r1"


def requests() -> list[tuple[Request, list[Entity], bool]]:
    """(request, per-call entities, expected allowed) for deployment 7."""
    w = EntityRef.workload(workload(7))
    table = EntityRef.table(TENANT, "ds7", "t3")

    def sql(columns: list[str]) -> Request:
        return Request(w, "sql.select", table, {"dataset": "ds7", "columns": columns})

    def http(host: str) -> tuple[Request, list[Entity]]:
        ctx: dict[str, CedarValue] = {"method": "GET", "port": 443, "path": "/v1/x"}
        return Request(w, "http.request", EntityRef.host(host), ctx), [Entity.host(host)]

    out: list[tuple[Request, list[Entity], bool]] = [
        (sql(["id", "country"]), [], True),
        (sql(["id", "email"]), [], False),
        (*http("api2.svc7.example.com"), True),
        (*http("img.cdn7.example.org"), True),
        (*http("evil.example.net"), False),
        (
            Request(w, "secret.use", EntityRef.secret(TENANT, "token1"), {"host": "x"}),
            [],
            True,
        ),
        (
            Request(w, "file.write", EntityRef.bucket(TENANT, "reports"), {"key": "a", "bytes": 9}),
            [],
            True,
        ),
    ]
    return out


def measure(fn: Callable[[], object], seconds: float) -> tuple[float, float, float, int]:
    for _ in range(50):
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    samples.sort()
    p50 = statistics.median(samples)
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    per_second = len(samples) / (sum(samples) / 1e6)
    return per_second, p50, p99, len(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per scenario")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()

    text = policy_text()
    compiled = compile_policies(text)
    # What a workload can match: its own deployment's permits and the tenant's
    # policies. Permits of other deployments never match it (their scope is
    # `principal in` another Deployment), so this set decides identically.
    own = compile_policies(capability_policies(TENANT, "dep7", capabilities(7)) + TENANT_FORBIDS)
    base = EntitySet(
        [Entity.workload(workload(7), tenant=TENANT, deployment="dep7", environment="production")]
    )
    mix = requests()
    # Per-call entities parsed once per distinct host, as a broker would cache them.
    prepared = [(r, base.with_added(e) if e else base, ok) for r, e, ok in mix]
    for request, entities, expected in prepared:
        for policies in (compiled, own):
            got = decide(policies, request, entities)
            assert got.allowed is expected and not got.errors, (request, got)

    def cycle(step: Callable[[int], Decision | object]) -> Callable[[], object]:
        counter = [0]

        def run() -> object:
            counter[0] += 1
            return step(counter[0] % len(mix))

        return run

    base_entities = [Entity.workload(workload(7), tenant=TENANT, deployment="dep7")]
    raw_requests = [r.to_cedar() for r, _, _ in mix]
    raw_entities = [e._handle for _, e, _ in prepared]

    scenarios: list[tuple[str, Callable[[], object]]] = [
        (
            "parsed once, entities reused (EntitySet)",
            cycle(lambda i: decide(compiled, prepared[i][0], prepared[i][1])),
        ),
        (
            f"per-deployment set ({len(own)} policies), parsed once, entities reused",
            cycle(lambda i: decide(own, prepared[i][0], prepared[i][1])),
        ),
        (
            "parsed once, base reused, per-call entity added",
            cycle(lambda i: decide(compiled, mix[i][0], base.with_added(mix[i][1]))),
        ),
        (
            "parsed once, entities parsed per call",
            cycle(lambda i: decide(compiled, mix[i][0], [*base_entities, *mix[i][1]])),
        ),
        (
            "cedarpy alone, handles reused, no schema (floor)",
            cycle(
                lambda i: cedarpy.is_authorized(
                    raw_requests[i],
                    compiled._policy_set,
                    raw_entities[i],
                    None,
                )
            ),
        ),
        (
            "re-parse text per decision (no validation)",
            cycle(lambda i: cedarpy.is_authorized(raw_requests[i], compiled.text, raw_entities[i])),
        ),
        (
            "compile_policies (parse + validate) per decision",
            cycle(lambda i: decide(compile_policies(text), prepared[i][0], prepared[i][1])),
        ),
    ]

    rows = []
    for name, fn in scenarios:
        per_second, p50, p99, n = measure(fn, args.seconds)
        rows.append((name, per_second, p50, p99, n))
        print(f"{name:58s} {per_second:>10,.0f}/s  p50 {p50:>9.1f} µs  p99 {p99:>9.1f} µs  (n={n})")

    header = (
        f"Policy set: {len(compiled)} policies ({DEPLOYMENTS} deployments' capability permits "
        f"and 3 tenant forbids), {len(text):,} bytes; a mix of {len(mix)} requests "
        f"(allowed and denied SQL, HTTP, secret, file). "
        f"cedarpy {getattr(cedarpy, '__version__', _cedarpy_version())}, "
        f"Python {platform.python_version()}, {platform.machine()}, one thread."
    )
    table = [
        "| scenario | decisions/s | p50 | p99 |",
        "|---|---:|---:|---:|",
        *[f"| {n} | {ps:,.0f} | {p50:.1f} µs | {p99:.1f} µs |" for n, ps, p50, p99, _ in rows],
    ]
    block = "\n".join([MARK_BEGIN, header, "", *table, MARK_END])
    if args.write_docs:
        doc = Path(__file__).resolve().parent.parent / "docs" / "policy.md"
        current = doc.read_text(encoding="utf-8")
        start, end = current.find(MARK_BEGIN), current.find(MARK_END)
        if start < 0 or end < 0:
            print(f"bench markers not found in {doc}", file=sys.stderr)
            return 1
        doc.write_text(current[:start] + block + current[end + len(MARK_END) :], encoding="utf-8")
        print(f"wrote {doc}")
    else:
        print()
        print(block)
    return 0


def _cedarpy_version() -> str:
    from importlib.metadata import version

    return version("cedarpy")


if __name__ == "__main__":
    sys.exit(main())
