"""docs/operations.md against what it describes: the metrics table is the runtime's
registry (every metric, its type and labels, nothing else), every alert of
deploy/prometheus has its row and its runbook section, the variables the Traces
section names are the ones telemetry reads, and the sections the lead fills in
are there."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.unit.metric_names import registry_families

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
RULES = ROOT / "deploy" / "prometheus" / "proctor.rules.yml"
TRACING = ROOT / "src" / "proctor" / "telemetry" / "_tracing.py"
_ROW = re.compile(r"^\| `(proctor_\w+)` \| (\w+) \|([^|]*)\| [^|]+ \|$", re.MULTILINE)


def _section(title: str) -> str:
    text = OPERATIONS.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"docs/operations.md has no section {title!r}"
    return match.group(1)


def _documented() -> dict[str, tuple[str, frozenset[str]]]:
    rows = {}
    for name, kind, labels in _ROW.findall(_section("Metrics")):
        assert name not in rows, f"{name} is in the table twice"
        rows[name] = (kind, frozenset(re.findall(r"`(\w+)`", labels)))
    return rows


def _registry() -> dict[str, tuple[str, frozenset[str]]]:
    """The runtime's metrics as PromQL names them: a counter with ``_total``."""
    out = {}
    for family, (kind, labels) in registry_families().items():
        if family.startswith("proctor_") and not family.endswith("_created"):
            out[family + ("_total" if kind == "counter" else "")] = (kind, labels)
    return out


def test_the_metrics_table_is_the_registry() -> None:
    documented, registry = _documented(), _registry()
    assert set(documented) == set(registry), (
        f"not in the docs: {sorted(set(registry) - set(documented))}; "
        f"not in the registry: {sorted(set(documented) - set(registry))}"
    )
    for name, (kind, labels) in registry.items():
        assert documented[name] == (kind, labels), f"{name}: docs {documented[name]}"


def test_the_table_check_can_fail() -> None:
    row = "| `proctor_calls_total` | counter | `kind`, `decision` | calls |"
    assert _ROW.findall(row) == [("proctor_calls_total", "counter", " `kind`, `decision` ")]
    assert _ROW.findall("| `proctor_x_total` | counter | | a count |")
    assert _registry()["proctor_calls_total"][1] != frozenset({"kind", "decision"})


def test_every_alert_has_its_row_and_runbook_section() -> None:
    text = _section("Alerts and the dashboard")
    alerts = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
              if "alert" in r]  # fmt: skip
    for rule in alerts:
        name = rule["alert"]
        assert re.search(rf"^### {name}$", text, re.MULTILINE), f"no section {name}"
        row = re.search(rf"^\| `{name}` \| (\w+) \|", text, re.MULTILINE)
        assert row and row.group(1) == rule["labels"]["severity"], name


def test_the_traces_section_names_the_variables_telemetry_reads() -> None:
    text = _section("Traces")
    read = set(re.findall(r'"(OTEL_\w+)"', TRACING.read_text()))
    assert {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME"} <= read  # fmt: skip
    for variable in read:
        assert f"`{variable}" in text, f"the Traces section omits {variable}"
    for span in ("proctor.run", "proctor.call ", "proctor.stage ", "proctor.ledger.seq"):
        assert span in text


def test_the_sections_the_lead_fills_are_there() -> None:
    for title in ("Metrics", "Traces", "Alerts and the dashboard", "Health",
                  "Backup and restore"):  # fmt: skip
        assert _section(title).strip()
