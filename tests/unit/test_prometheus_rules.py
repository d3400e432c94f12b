"""deploy/prometheus: the alert rules pass ``promtool check rules`` and their unit
tests (``promtool test rules``); those tests can fail (each alert's firing case
fails once its expression never fires, and once its series are flattened); every
alert has a case that fires and one that must not; every metric and label the
rules name is one the runtime exposes (a renamed metric breaks the build instead
of silencing an alert); each alert says how bad it is and where its runbook is;
the example scrape configuration passes ``promtool check config``, and so does
the static one docs/operations.md shows.

promtool is Debian's (the ``prometheus`` package, which scripts/setup.sh
installs): missing, these tests fail rather than skip."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.metric_names import promql_names, promtool, registry_series, unknown_names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "prometheus"
RULES = DEPLOY / "proctor.rules.yml"
TESTS = DEPLOY / "proctor.rules.test.yml"
CONFIG = DEPLOY / "prometheus.yml"
OPERATIONS = ROOT / "docs" / "operations.md"
SEVERITIES = {"critical", "warning"}
#: Where the example configuration expects its secrets (moved for the check).
SECRETS_DIR = "/etc/prometheus/proctor/"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [r for r in _rules() if "alert" in r]


ALERTS = [r["alert"] for r in _alerts()]


def _unit_tests() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(TESTS.read_text())
    return doc


def _groups_for(alert: str) -> list[dict[str, Any]]:
    """The unit tests of ``alert`` alone (the day-long series are slow to evaluate
    for every rule)."""
    out = []
    for group in _unit_tests()["tests"]:
        evals = [t for t in group.get("alert_rule_test", []) if t["alertname"] == alert]
        if evals:
            out.append(dict(group, alert_rule_test=evals))
    return out


def _rules_of(alert: str) -> dict[str, Any]:
    """The rule file with ``alert``'s rule alone."""
    rules: dict[str, Any] = yaml.safe_load(RULES.read_text())
    rules["groups"] = [dict(g, rules=[r for r in g["rules"] if r.get("alert") == alert])
                       for g in rules["groups"]]  # fmt: skip
    rules["groups"] = [g for g in rules["groups"] if g["rules"]]
    return rules


def _write_case(where: Path, rules: dict[str, Any], groups: list[dict[str, Any]]) -> Path:
    """A copy of the rules and of some of their unit tests in ``where``."""
    (where / RULES.name).write_text(yaml.safe_dump(rules, sort_keys=False))
    tests = dict(_unit_tests(), tests=groups)
    path = where / TESTS.name
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    return path


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the page's headings."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return out


# -- promtool ------------------------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    done = _run("check", "rules", "--lint=all", "--lint-fatal", RULES.name, cwd=DEPLOY)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


def test_the_rules_pass_their_unit_tests() -> None:
    done = _run("test", "rules", TESTS.name, cwd=DEPLOY)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_refuses_a_broken_rule(tmp_path: Path) -> None:
    """The check above can fail: a misspelled function and a bad duration are refused."""
    for broken, why in (("rat(proctor_calls_total[5m]) > 0", "rat"),
                        ("rate(proctor_calls_total[5q]) > 0", "bad duration")):  # fmt: skip
        rules = yaml.safe_load(RULES.read_text())
        rules["groups"][0]["rules"][0]["expr"] = broken
        (tmp_path / "bad.yml").write_text(yaml.safe_dump(rules))
        done = _run("check", "rules", "bad.yml", cwd=tmp_path)
        assert done.returncode != 0 and why in done.stdout + done.stderr


def test_every_alert_has_a_case_that_fires_and_one_that_must_not() -> None:
    for alert in ALERTS:
        evals = [t for g in _groups_for(alert) for t in g["alert_rule_test"]
                 if t["alertname"] == alert]  # fmt: skip
        assert [t for t in evals if t.get("exp_alerts")], f"{alert}: no case where it fires"
        assert [t for t in evals if not t.get("exp_alerts")], f"{alert}: no quiet case"


@pytest.mark.parametrize("alert", ALERTS)
def test_an_alert_that_never_fires_fails_its_tests(alert: str, tmp_path: Path) -> None:
    groups = _groups_for(alert)
    passing = _run("test", "rules", _write_case(tmp_path, _rules_of(alert), groups).name, cwd=tmp_path)  # fmt: skip
    assert passing.returncode == 0, passing.stdout + passing.stderr
    rules = _rules_of(alert)
    (group,) = rules["groups"]
    group["rules"][0]["expr"] = "vector(1) == 0"
    done = _run("test", "rules", _write_case(tmp_path, rules, groups).name, cwd=tmp_path)
    assert done.returncode != 0, f"{alert}'s tests pass though it never fires"
    assert f"alertname: {alert}" in done.stdout + done.stderr


def _sample_count(values: str) -> tuple[float, int]:
    """The first number and the count of samples of promtool's series notation
    (``a+bxn`` is n+1 samples, ``_xn`` n missing ones)."""
    first: float | None = None
    count = 0
    for token in values.split():
        base, _, times = token.partition("x")
        n = int(times) if times else 0
        if base.startswith("_"):
            count += max(n, 1)
            continue
        count += n + 1
        if first is None:
            first = float(re.match(r"-?[\d.e]+", base).group())  # type: ignore[union-attr]
    assert first is not None, values
    return first, count


@pytest.mark.parametrize("alert", [a for a in ALERTS if a != "ProctorTargetMissing"])
def test_an_alert_fed_flat_series_fails_its_tests(alert: str, tmp_path: Path) -> None:
    """Every series held at its first value (no counter moves, no gauge climbs): the
    cases that expect the alert must fail, so they depend on the series."""
    groups = copy.deepcopy(_groups_for(alert))
    for group in groups:
        for series in group["input_series"]:
            first, count = _sample_count(series["values"])
            series["values"] = f"{first:g}x{count - 1}"
    done = _run("test", "rules", _write_case(tmp_path, _rules_of(alert), groups).name, cwd=tmp_path)
    assert done.returncode != 0, f"{alert}'s tests pass on flat series"
    assert f"alertname: {alert}" in done.stdout + done.stderr


def test_the_missing_target_alert_stops_once_a_target_is_found(tmp_path: Path) -> None:
    groups = copy.deepcopy(_groups_for("ProctorTargetMissing"))
    for group in groups:
        group["input_series"].append({"series": 'up{job="proctor", instance="n9:8470"}',
                                      "values": "1x40"})  # fmt: skip
    rules = _rules_of("ProctorTargetMissing")
    done = _run("test", "rules", _write_case(tmp_path, rules, groups).name, cwd=tmp_path)
    assert done.returncode != 0
    assert "alertname: ProctorTargetMissing" in done.stdout + done.stderr


# -- names against the registry ------------------------------------------------------


def test_every_name_in_the_rules_is_one_the_runtime_exposes() -> None:
    for rule in _rules():
        assert not unknown_names(rule["expr"]), (rule.get("alert"), unknown_names(rule["expr"]))
    used = {m for r in _rules() for m in promql_names(r["expr"]).metrics}
    assert {"proctor_ledger_write_failures_total", "proctor_witness_checkpoint_age_seconds",
            "proctor_runs", "proctor_broker_connections", "proctor_calls_total",
            "proctor_api_requests_total", "up"} <= used  # fmt: skip


def test_a_renamed_metric_is_caught() -> None:
    """The check above can fail: names the registry lacks, a label a metric lacks."""
    series = registry_series()
    assert "proctor_ledger_write_failures_total" in series
    assert "proctor_ledger_write_failures" not in series  # a counter is exposed as _total
    assert "proctor_call_duration_seconds_bucket" in series
    assert "tenant" in series["proctor_calls_total"]
    assert unknown_names("increase(proctor_ledger_write_failure_total[5m]) > 0") == [
        "no metric proctor_ledger_write_failure_total"]  # fmt: skip
    assert unknown_names('proctor_runs{status="starting"}') == ["proctor_runs has no label status"]
    assert unknown_names("sum by (tenant) (proctor_runs)") == [
        "no metric here has a label tenant"]  # fmt: skip


def test_the_promql_scan_on_examples() -> None:
    names = promql_names(
        "histogram_quantile(0.99, sum by (le) (rate(proctor_call_duration_seconds_bucket"
        '{kind=~"$kind", tenant!="a{b}"}[$__rate_interval]))) > 1e3 '
        "and on (job, instance) up offset 5m == bool 0 unless ignoring(x) vector(1)"
    )
    assert names.metrics == {"proctor_call_duration_seconds_bucket", "up"}
    assert names.matched == {("proctor_call_duration_seconds_bucket", "kind"),
                             ("proctor_call_duration_seconds_bucket", "tenant")}  # fmt: skip
    assert names.grouped == {"le", "job", "instance", "x"}
    # A function's name is not a metric's; a bare matcher selects none.
    assert promql_names("rate(x[5m])").metrics == {"x"}
    assert promql_names('{__name__="up"}').matched == {(None, "__name__")}
    assert promql_names("sum(a) without (tenant) / on() group_left(kind) b").metrics == {"a", "b"}


# -- what each alert carries ---------------------------------------------------------


def test_each_alert_waits_says_how_bad_and_links_its_runbook() -> None:
    anchors = _anchors(OPERATIONS.read_text())
    for rule in _alerts():
        name = rule["alert"]
        assert re.fullmatch(r"Proctor[A-Z]\w+", name), name
        assert rule.get("for"), f"{name} has no for:"
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page == "docs/operations.md" and anchor == name.lower(), name
        assert anchor in anchors, f"docs/operations.md has no section {name}"


# -- the scrape configuration --------------------------------------------------------


def _check_config(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check config`` (rules included, files it reads present) of ``text``
    with its secrets moved into ``tmp_path``."""
    (tmp_path / "token").write_text("0" * 64 + "\n")
    (tmp_path / "ca.crt").write_text("")
    shutil.copy(RULES, tmp_path / RULES.name)
    config = tmp_path / "prometheus.yml"
    config.write_text(text.replace(SECRETS_DIR, f"{tmp_path}/"))
    return _run("check", "config", "--lint=all", "--lint-fatal", config.name, cwd=tmp_path)


def test_promtool_checks_the_example_configuration(tmp_path: Path) -> None:
    done = _check_config(CONFIG.read_text(), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout
    (job,) = yaml.safe_load(CONFIG.read_text())["scrape_configs"]
    assert job["job_name"] == "proctor"  # the name up{job="proctor"} selects
    assert job["scheme"] == "https" and "credentials_file" in job["authorization"]
    # The check can fail: a token file that is not there is refused.
    (tmp_path / "token").unlink()
    missing = _run("check", "config", "prometheus.yml", cwd=tmp_path)
    assert missing.returncode != 0 and "token" in missing.stdout + missing.stderr


def test_the_static_configuration_in_the_docs_passes_promtool(tmp_path: Path) -> None:
    text = OPERATIONS.read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
              if "static_configs" in b]  # fmt: skip
    assert len(blocks) == 1, "docs/operations.md shows one static scrape configuration"
    config = "rule_files: [proctor.rules.yml]\nscrape_configs:\n" + blocks[0]
    done = _check_config(config, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (job,) = yaml.safe_load(config)["scrape_configs"]
    assert job["job_name"] == "proctor"
