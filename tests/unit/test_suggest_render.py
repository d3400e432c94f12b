"""The suggestion's TOML writer: what it writes parses back to the same manifest (names,
quotes, control characters, IPv6, wildcards, request rules, asked calls, every limit, a schedule),
so a suggested manifest is one a person can submit as it is."""

from __future__ import annotations

from pathlib import Path

from proctor.governance import load_manifest, parse_manifest
from proctor.governance._suggest import _text, render

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "churn-report"

ODD = r"""
[artifact]
name = "x"
entrypoint = ["python3", "-c", "1", "\u00e9\\"]
purpose = "p\twith \"quotes\" and\nnewline é 😀"
[datasets.crm.tables."weird table"]
columns = ["a b", "c", "\"q\""]
access = "read-write"
[egress]
hosts = ["api.example.com", "[::1]:8080", "*.cdn.example.org"]
[egress.rules."api.example.com:443"]
methods = ["GET"]
paths = ["/v1/*"]
request_bytes = "1M"
body_digests = true
[secrets]
names = ["tok"]
[buckets]
reports = "read-write"
[ask]
egress = ["api.example.com"]
buckets = ["reports"]
tables = ["crm.weird table"]
timeout = "90s"
[limits]
memory = "256M"
timeout = "500ms"
pids = 7
cpu = 0.5
output = "1K"
calls_per_second = 0.00001
call_burst = 3
calls = 9
[lifecycle]
mode = "schedule"
every = "1h"
"""


def test_what_it_writes_parses_back_to_the_same_manifest() -> None:
    for manifest in (parse_manifest(ODD), load_manifest(EXAMPLE)):
        text = _text(render(manifest, manifest.capabilities))
        assert parse_manifest(text) == manifest, text


def test_a_service_keeps_its_restart_policy() -> None:
    manifest = parse_manifest(
        '[artifact]\nname = "s"\nentrypoint = ["/bin/true"]\npurpose = "p"\n'
        '[lifecycle]\nmode = "service"\nrestart = "always"\n'
    )
    text = _text(render(manifest, manifest.capabilities))
    assert 'restart = "always"' in text and parse_manifest(text) == manifest


def test_request_rules_are_suggested_only_where_they_allow_exactly_the_calls() -> None:
    from proctor.governance._suggest import _rules_of

    host = "api.example.com:80"
    assert _rules_of(host, {("GET", "/v1/a"), ("POST", "/v1/b")}) == {
        "methods": ["GET", "POST"], "paths": ["/v1/a", "/v1/b"],
    }  # fmt: skip
    # A path that would be a pattern (more than the call), one a rule cannot hold, a
    # CONNECT (its requests unseen), too many paths: no rules, never wider ones.
    for requests in ({("GET", "/v1/*")}, {("GET", "/v1/%2e%2e")}, {("GET", "/a//b")},
                     {("CONNECT", None)}, {("GET", f"/c/{i}") for i in range(17)}):  # fmt: skip
        assert _rules_of(host, requests) is None, requests
