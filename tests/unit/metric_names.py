"""What the alert rules (deploy/prometheus) and the dashboard (deploy/grafana) may
name: the series the runtime's own registry exposes, read from a real exposition,
and the metric and label names a PromQL expression uses.

The registry is read in a child process (metrics are turned on once per process,
and this one keeps them off). Every labelled metric is given one child there, so
that its label names are in the exposition too."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

#: Series Prometheus makes itself for each target, and the labels it puts on
#: every scraped series (the scrape configs under deploy/ relabel nothing).
PROMETHEUS_SERIES = {"up": set(), "scrape_duration_seconds": set(), "ALERTS": set()}
TARGET_LABELS = {"job", "instance"}

_EXPOSE = r"""
import json
from dataclasses import fields
from prometheus_client.parser import text_string_to_metric_families
from proctor import telemetry

m = telemetry.enable_metrics(tenant_labels=True)
for f in fields(m):
    metric = getattr(m, f.name)
    for n in range(8):  # the metric's label count, found by asking: public calls only
        try:
            metric.labels(*["x"] * n)
            break
        except ValueError:
            continue
body, _ = telemetry.exposition()
series, families = {}, {}
for family in text_string_to_metric_families(body.decode()):
    labels = set()
    for sample in family.samples:
        series.setdefault(sample.name, set()).update(sample.labels)
        labels.update(sample.labels)
    families[family.name] = [family.type, sorted(labels - {"le"})]
print(json.dumps({"series": {name: sorted(labels) for name, labels in series.items()},
                  "families": families}))
"""


def promtool() -> str:
    """Debian's promtool (the ``prometheus`` package, which scripts/setup.sh installs):
    missing, a test fails rather than skips."""
    found = shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
    if found is None:
        pytest.fail("promtool is missing: scripts/setup.sh installs it (Debian's prometheus)")
    return found


@functools.cache
def _exposition() -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _EXPOSE], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    out: dict[str, Any] = json.loads(done.stdout)
    assert "proctor_calls_total" in out["series"], "the exposition lacks the runtime's metrics"
    return out


def registry_series() -> dict[str, frozenset[str]]:
    """Every series name of the runtime's exposition (counters as ``_total``,
    histograms as ``_bucket``/``_sum``/``_count``) and its label names."""
    return {name: frozenset(labels) for name, labels in _exposition()["series"].items()}


def registry_families() -> dict[str, tuple[str, frozenset[str]]]:
    """The exposition's metric families (a counter's name without ``_total``): their
    type (counter, gauge, histogram) and label names (``le`` aside)."""
    return {name: (kind, frozenset(labels))
            for name, (kind, labels) in _exposition()["families"].items()}  # fmt: skip


def known_series() -> dict[str, frozenset[str]]:
    """What an expression may select: the registry's series and Prometheus's own."""
    out = {name: frozenset(labels) for name, labels in PROMETHEUS_SERIES.items()}
    out.update(registry_series())
    return out


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_RANGE = re.compile(r"\$__\w+|\$\{__[^}]*\}")
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_MATCHERS = re.compile(r"([A-Za-z_:][\w:]*)?\s*\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_OFFSET = re.compile(r"\boffset\s+-?\w+")
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left",
             "group_right", "offset", "inf", "nan", "Inf", "NaN"}  # fmt: skip


@dataclass
class Names:
    """The names one PromQL expression uses."""

    metrics: set[str] = field(default_factory=set)
    #: (the metric a matcher selects, or None for a bare {...}, the label name).
    matched: set[tuple[str | None, str]] = field(default_factory=set)
    #: Label names of by/without/on/ignoring/group_left/group_right clauses.
    grouped: set[str] = field(default_factory=set)


def promql_names(expr: str) -> Names:
    """The metric and label names of a PromQL expression (Grafana's variables
    allowed): a careful scan, not a parser, tried on examples in the tests."""
    names = Names()
    text = _GRAFANA_RANGE.sub("5m", expr)
    text = _STRING.sub('""', text)
    text = _GRAFANA_VAR.sub("5m", text)
    for metric, body in _MATCHERS.findall(text):
        for label in _MATCHER_LABEL.findall(body):
            names.matched.add((metric or None, label))
    text = _MATCHERS.sub(lambda m: f" {m.group(1) or ''} ", text)
    for body in _GROUPING.findall(text):
        names.grouped.update(x.strip() for x in body.split(",") if x.strip())
    text = _GROUPING.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    for ident in _IDENT.findall(text):
        if ident not in _KEYWORDS:
            names.metrics.add(ident)
    for metric, _ in names.matched:
        if metric is not None:
            names.metrics.add(metric)
    return names


def unknown_names(expr: str) -> list[str]:
    """What ``expr`` names that the runtime does not expose: metrics, a matcher's
    label the metric lacks, a grouping label none of its metrics carries."""
    known = known_series()
    names = promql_names(expr)
    problems = [f"no metric {m}" for m in sorted(names.metrics) if m not in known]
    for metric, label in sorted(names.matched, key=str):
        if metric in known and label not in known[metric] | TARGET_LABELS:
            problems.append(f"{metric} has no label {label}")
    carried = set(TARGET_LABELS)
    for m in names.metrics:
        carried |= known.get(m, frozenset())
    problems += [f"no metric here has a label {g}" for g in sorted(names.grouped - carried)]
    return problems
