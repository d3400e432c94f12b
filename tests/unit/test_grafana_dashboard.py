"""deploy/grafana/proctor.json: a Grafana dashboard Grafana imports (its schema's
required parts: uid, title, schemaVersion, panels laid out on the 24-column grid
without overlapping, each query with a refId and an expr); the data source is a
variable, never a uid of someone's Grafana; every metric and label its queries
and variables name is one the runtime exposes; every metric of the runtime is on
it; a metric with a tenant label is filtered by the tenant variable, and every
selector by the job and node variables."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.unit.metric_names import (
    known_series,
    promql_names,
    promtool,
    registry_families,
    registry_series,
    unknown_names,
)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "proctor.json"
GRID = 24
#: Grafana's own annotation source (alerts and annotations on the dashboard).
BUILTIN = {"type": "grafana", "uid": "-- Grafana --"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_LABEL_VALUES = re.compile(r"^label_values\((?:(.*),\s*)?(\w+)\)$")


def _load() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel query."""
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]


def _variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def _datasources(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            else:
                yield from _datasources(value)
    elif isinstance(node, list):
        for item in node:
            yield from _datasources(item)


def problems(dashboard: dict[str, Any]) -> list[str]:
    """Everything wrong with ``dashboard``; empty when it is right."""
    out: list[str] = []
    for key in ("uid", "title"):
        if not isinstance(dashboard.get(key), str) or not dashboard[key]:
            out.append(f"no {key}")
    if len(dashboard.get("uid", "")) > 40:
        out.append("uid over 40 characters")
    if not isinstance(dashboard.get("schemaVersion"), int) or dashboard["schemaVersion"] < 36:
        out.append("schemaVersion missing or older than Grafana 9")
    variables = _variables(dashboard)
    source = variables.get("datasource", {})
    if source.get("type") != "datasource" or source.get("query") != "prometheus":
        out.append("no Prometheus data source variable")
    for ds in _datasources(dashboard):
        if ds not in (DATASOURCE, BUILTIN):
            out.append(f"a data source that is not the variable: {ds!r}")
    ids: set[int] = set()
    cells: dict[tuple[int, int], str] = {}
    for panel in _panels(dashboard):
        title = panel.get("title", "?")
        if panel.get("id") in ids or not isinstance(panel.get("id"), int):
            out.append(f"panel {title!r}: id missing or repeated")
        ids.add(panel.get("id", -1))
        pos = panel.get("gridPos", {})
        if not all(isinstance(pos.get(k), int) for k in "hwxy"):
            out.append(f"panel {title!r}: no gridPos")
            continue
        if pos["x"] < 0 or pos["w"] < 1 or pos["x"] + pos["w"] > GRID:
            out.append(f"panel {title!r}: outside the grid")
        for dx in range(pos["w"]):
            for dy in range(pos["h"]):
                cell = (pos["x"] + dx, pos["y"] + dy)
                if cell in cells:
                    out.append(f"panel {title!r} overlaps {cells[cell]!r}")
                    break
                cells[cell] = title
            else:
                continue
            break
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        if not targets:
            out.append(f"panel {title!r}: no query")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or not all(refs):
            out.append(f"panel {title!r}: refIds missing or repeated")
        out += [f"panel {title!r}: a query without expr" for t in targets if not t.get("expr")]
    tenanted = {m for m, labels in known_series().items() if "tenant" in labels}
    for where, expr in _queries(dashboard):
        out += [f"{where}: {p}" for p in unknown_names(expr)]
        names = promql_names(expr)
        for metric in names.metrics - {"up"}:
            if not {(metric, "job"), (metric, "instance")} <= names.matched:
                out.append(f"{where}: {metric} not filtered by $job and $instance")
            if metric in tenanted and (metric, "tenant") not in names.matched:
                out.append(f"{where}: {metric} not filtered by $tenant")
    for name, variable in variables.items():
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else ""
        found = _LABEL_VALUES.match(query)
        if found is None:
            out.append(f"variable {name}: not a label_values query")
            continue
        selector, label = found.groups()
        out += [f"variable {name}: {p}" for p in unknown_names(selector or "up")]
        for metric in promql_names(selector or "up").metrics:
            if label not in known_series().get(metric, frozenset()) | {"job", "instance"}:
                out.append(f"variable {name}: {metric} has no label {label}")
    return out


def test_the_dashboard_is_valid_and_names_only_what_the_runtime_exposes() -> None:
    assert problems(_load()) == []


def test_every_metric_of_the_runtime_is_on_the_dashboard() -> None:
    used = set()
    for _, expr in _queries(_load()):
        used |= promql_names(expr).metrics
    series = registry_series()
    for family, (kind, _) in registry_families().items():
        if not family.startswith("proctor_") or family.endswith("_created"):
            continue
        shown = {"counter": {f"{family}_total"},
                 "histogram": {f"{family}_bucket", f"{family}_sum", f"{family}_count"},
                 "gauge": {family}}[kind]  # fmt: skip
        assert shown <= set(series)
        assert used & shown, f"{family} is on no panel"


def test_the_variables_select_job_node_and_tenant() -> None:
    variables = _variables(_load())
    assert set(variables) == {"datasource", "job", "instance", "tenant"}
    tenant = variables["tenant"]
    assert tenant["query"]["query"].endswith(", tenant)")
    # All must match a series without the label (tenant labels off): not a list of
    # the names found, which would be empty.
    assert tenant["includeAll"] is True and tenant["allValue"] == ".*"
    assert re.fullmatch(tenant["allValue"], "")
    for name in ("job", "instance", "tenant"):
        assert variables[name]["datasource"] == DATASOURCE


def test_a_broken_dashboard_is_caught() -> None:
    """The check above can fail: each of these is found."""
    good = _load()

    def broken(change: Any) -> list[str]:
        dashboard = copy.deepcopy(good)
        change(dashboard)
        return problems(dashboard)

    def first_query(d: dict[str, Any]) -> dict[str, Any]:
        target: dict[str, Any] = next(p for p in _panels(d) if p.get("targets"))["targets"][0]
        return target

    def rename(d: dict[str, Any]) -> None:
        first_query(d)["expr"] = (
            'sum(rate(proctor_call_total{job=~"$job", instance=~"$instance"}[5m]))'
        )

    def hard_coded(d: dict[str, Any]) -> None:
        first_query(d)["datasource"] = {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}

    def unfiltered(d: dict[str, Any]) -> None:
        first_query(d)["expr"] = "sum(rate(proctor_calls_total[5m]))"

    def overlapping(d: dict[str, Any]) -> None:
        panels = [p for p in d["panels"] if p["type"] != "row"]
        panels[1]["gridPos"] = dict(panels[0]["gridPos"])

    def wrong_label(d: dict[str, Any]) -> None:
        _variables(d)["tenant"]["query"]["query"] = "label_values(proctor_runs, tenant)"

    assert any("no metric proctor_call_total" in p for p in broken(rename))
    assert any("not the variable" in p for p in broken(hard_coded))
    found = broken(unfiltered)
    assert any("not filtered by $job" in p for p in found)
    assert any("not filtered by $tenant" in p for p in found)
    assert any("overlaps" in p for p in broken(overlapping))
    assert any("proctor_runs has no label tenant" in p for p in broken(wrong_label))
    assert any("no uid" in p for p in broken(lambda d: d.pop("uid")))


def _as_rules(dashboard: dict[str, Any]) -> str:
    """Every panel query as a recording rule, Grafana's variables given values."""
    rules = []
    for i, (_, expr) in enumerate(_queries(dashboard)):
        expr = expr.replace("$__rate_interval", "5m")
        expr = re.sub(r"\$\{?(job|instance|tenant)\}?", ".*", expr)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    return yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})


def test_promql_parses_every_panel_query(tmp_path: Path) -> None:
    """Prometheus's own parser (promtool check rules) reads each query."""
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(_as_rules(_load()))
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # It can fail: a query with an unclosed call is refused.
    bad = _load()
    next(p for p in _panels(bad) if p.get("targets"))["targets"][0]["expr"] = "sum(rate(up[5m])"
    path.write_text(_as_rules(bad))
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode != 0 and "dashboard:query_0" in done.stdout + done.stderr
