"""deploy/prometheus/proctor.rules.yml and deploy/grafana/proctor.json on a real
Prometheus (Debian's) scraping a real ``proctor serve`` every second: every rule
is evaluated on the runtime's real series without an error (a many-to-many match
or a label clash shows only there, not in promtool's synthetic series), every
panel query answers, a healthy idle node raises no alert, and once serve is gone
ProctorTargetDown is pending on it.

No run is started (the sandboxed scrape is tests/e2e/test_prometheus_scrape.py):
this is about the rules and the queries, not the counts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proctor.runtime import init_home
from tests.conftest import PROCTOR, wait_until
from tests.prometheus_support import free_port, prometheus, stop

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "proctor.rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "proctor.json"


@dataclass
class Live:
    prometheus: str
    serve: subprocess.Popen[bytes]
    serve_log: Path

    def get(self, path: str, **params: str) -> Any:
        doc = httpx.get(f"{self.prometheus}{path}", params=params, timeout=10).json()
        assert doc["status"] == "success", doc
        return doc["data"]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("rules-live")
    home = tmp / "home"
    init_home(home)
    metrics_port, api_port, prom_port = free_port(), free_port(), free_port()
    shutil.copy(RULES, tmp / RULES.name)
    config = tmp / "prometheus.yml"
    config.write_text(textwrap.dedent(f"""\
        global:
          scrape_interval: 1s
          scrape_timeout: 1s
          evaluation_interval: 1s
        rule_files: [{RULES.name}]
        scrape_configs:
          - job_name: proctor
            static_configs: [{{targets: ["127.0.0.1:{metrics_port}"]}}]
        """))  # fmt: skip
    serve_log, prom_log = tmp / "serve.stderr", tmp / "prometheus.stderr"
    env = dict(os.environ, PROCTOR_HOME=str(home))
    procs: list[subprocess.Popen[bytes]] = []
    stack = ExitStack()
    try:
        with serve_log.open("wb") as err:
            procs.append(subprocess.Popen(
                [PROCTOR, "serve", "--backend", "gvisor", "--api-port", str(api_port),
                 "--metrics-port", str(metrics_port), "--metrics-tenant-labels"],
                env=env, stdout=subprocess.DEVNULL, stderr=err,
            ))  # fmt: skip
        procs.append(stack.enter_context(prometheus(config, prom_port, prom_log)))
        live = Live(f"http://127.0.0.1:{prom_port}", procs[0], serve_log)

        def up() -> bool:
            assert procs[0].poll() is None, serve_log.read_text()
            assert procs[1].poll() is None, prom_log.read_text()
            try:
                result = live.get("/api/v1/query", query='up{job="proctor"} == 1')["result"]
            except httpx.HTTPError:
                return False
            return bool(result)

        wait_until(up, "Prometheus scraping serve")
        yield live
    finally:
        stack.close()
        if procs:
            stop(procs[0])


def _when(rfc3339: str) -> float:
    """Epoch seconds of Prometheus's RFC 3339 times (nanoseconds cut to micro)."""
    head, _, frac = rfc3339.rstrip("Z").partition(".")
    return datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp() + float(f"0.{frac or 0}")


def _rules(live: Live) -> list[dict[str, Any]]:
    return [r for g in live.get("/api/v1/rules")["groups"] for r in g["rules"]]


def test_every_rule_evaluates_on_the_runtimes_series_without_error(live: Live) -> None:
    expected = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
                for r in g["rules"]]  # fmt: skip

    def evaluated() -> bool:
        rules = _rules(live)
        return len(rules) == len(expected) and all(
            not r["lastEvaluation"].startswith("0001") for r in rules
        )

    wait_until(evaluated, "every rule evaluated once")
    wait_until(lambda: live.get("/api/v1/query", query="proctor_build_info")["result"],
               "a scrape with the runtime's metrics")  # fmt: skip
    # Every rule evaluated again since that scrape (before it, no target was absent).
    scraped = float(live.get("/api/v1/query", query="time()")["result"][0])
    wait_until(lambda: all(_when(r["lastEvaluation"]) > scraped for r in _rules(live)),
               "every rule evaluated on the scraped series")  # fmt: skip
    rules = _rules(live)
    assert sorted(r["name"] for r in rules) == sorted(expected)
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # Healthy and idle: nothing pending, nothing firing.
    assert [(r["name"], r["state"]) for r in rules if r["state"] != "inactive"] == []


def test_every_dashboard_query_answers(live: Live) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    answered = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m")
            expr = re.sub(r"\$\{?(job|instance|tenant)\}?", ".*", expr)
            live.get("/api/v1/query", query=expr)  # an error fails in get
            answered += 1
    assert answered > 30
    # The build info panel reads this serve's version.
    result = live.get("/api/v1/query", query='proctor_build_info{job=~".*"}')["result"]
    assert [r["metric"]["version"] for r in result]


def test_a_node_that_is_gone_makes_target_down_pending(live: Live) -> None:
    stop(live.serve)
    assert live.serve.returncode == 0, live.serve_log.read_text()

    def pending() -> list[dict[str, Any]]:
        alerts = live.get("/api/v1/alerts")["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "ProctorTargetDown"]

    (alert,) = wait_until(pending, "ProctorTargetDown pending")
    assert alert["state"] == "pending"  # its for: 5m has not passed
    assert alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"] == "docs/operations.md#proctortargetdown"
