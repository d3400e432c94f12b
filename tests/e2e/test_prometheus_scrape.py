"""Issue 34: a real Prometheus (Debian's) scrapes a real ``proctor serve`` while a job
makes allowed and denied calls in a real sandbox, and PromQL through Prometheus's
HTTP API returns the counts the ledger holds.

Prometheus scrapes serve twice, every second: ``--metrics-port`` (no token, on
loopback), and the API's ``/metrics`` with the scrape token from the file serve
reads (``authorization.credentials_file``), as docs/operations.md configures it.
The API's ``/metrics`` refuses a scrape without the token, and a tenant's admin.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PROCTOR, wait_until
from tests.e2e.conftest_gov import Gov, build_gov
from tests.prometheus_support import free_port, prometheus, stop
from tests.sandbox_conftest_helpers import working

pytestmark = [pytest.mark.sandbox, pytest.mark.host]
BACKEND = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[0]

JOB = """
import json, proctor_guest
res = {"sql": proctor_guest.sql("fake", "SELECT id FROM customers WHERE id <= 2")["row_count"]}
res["write"] = proctor_guest.write("reports", "m.txt", b"metered")["bytes"]
res["read"] = proctor_guest.read("reports", "m.txt").decode()
res["denied"] = 0
for i in range(2):  # a bucket the run was not approved for
    try:
        proctor_guest.write("other", f"x{i}", b"x")
    except proctor_guest.GuestError:
        res["denied"] += 1
print(json.dumps(res), flush=True)
"""
CAPS = """
[datasets.fake.tables.customers]
columns = ["id", "country"]
access = "read"
[buckets]
reports = "read-write"
"""


@dataclass
class Scraped:
    gov: Gov
    api: str
    prometheus: str
    token: str
    run: dict[str, Any]
    stdout: dict[str, Any]

    def query(self, promql: str) -> float | None:
        """The value of an instant query that answers one sample (None: no sample)."""
        got = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": promql}, timeout=10)
        doc = got.json()
        assert doc["status"] == "success", doc
        result = doc["data"]["result"]
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def until(self, promql: str, expected: float) -> None:
        """Prometheus sees ``expected`` once it has scraped since (every second)."""
        seen: list[float | None] = []

        def now() -> bool:
            seen.append(self.query(promql))
            return seen[-1] == expected

        try:
            wait_until(now, f"{promql} == {expected}", timeout=60)
        except AssertionError:
            raise AssertionError(f"{promql}: last {seen[-1]}, expected {expected}") from None


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    tmp = tmp_path_factory.mktemp("scrape")
    gov = build_gov(tmp)
    rt = gov.rt
    digest = gov.submit("acme", gov.artifact_dir("metered", JOB, CAPS))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "metered",
                          environment="sandbox", instruction="metered", actor=gov.op)  # fmt: skip
    token = secrets.token_hex(32)
    token_file = tmp / "scrape.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    api_port, metrics_port, prom_port = free_port(), free_port(), free_port()
    config = tmp / "prometheus.yml"
    config.write_text(textwrap.dedent(f"""\
        global:
          scrape_interval: 1s
          scrape_timeout: 1s
        scrape_configs:
          - job_name: proctor
            static_configs: [{{targets: ["127.0.0.1:{metrics_port}"]}}]
          - job_name: proctor-api
            authorization: {{credentials_file: {token_file}}}
            static_configs: [{{targets: ["127.0.0.1:{api_port}"]}}]
        """))  # fmt: skip
    env = dict(os.environ, PROCTOR_HOME=str(gov.home))
    serve_log, prom_log = tmp / "serve.stderr", tmp / "prometheus.stderr"
    procs: list[subprocess.Popen[bytes]] = []
    stack = ExitStack()
    try:
        with serve_log.open("wb") as err:
            procs.append(subprocess.Popen(
                [PROCTOR, "serve", "--backend", BACKEND, "--api-port", str(api_port),
                 "--metrics-port", str(metrics_port), "--metrics-token-file", str(token_file),
                 "--metrics-tenant-labels"],
                env=env, stdout=subprocess.DEVNULL, stderr=err,
            ))  # fmt: skip
        procs.append(stack.enter_context(prometheus(config, prom_port, prom_log)))
        api, prom = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{prom_port}"

        def answers(url: str) -> bool:
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(lambda: answers(f"{api}/healthz") or procs[0].poll() is not None,
                   "serve's API")  # fmt: skip
        assert procs[0].poll() is None, serve_log.read_text()
        wait_until(lambda: answers(f"{prom}/-/ready") or procs[1].poll() is not None,
                   "Prometheus")  # fmt: skip
        assert procs[1].poll() is None, prom_log.read_text()
        # The job, started through the API as a person would, its output streamed.
        lines: list[dict[str, Any]] = []
        with httpx.stream(
            "POST", f"{api}/tenants/acme/deployments/metered/runs", timeout=120,
            headers={"Authorization": f"Bearer {gov.token('dev')}"},
        ) as resp:  # fmt: skip
            assert resp.status_code == 200, resp.read()
            lines = [json.loads(line) for line in resp.iter_lines() if line]
        run = lines[-1].get("run")
        assert run is not None and run["status"] == "succeeded", (lines, serve_log.read_text())
        out = "".join(d["data"] for d in lines if d.get("stream") == "stdout")
        yield Scraped(gov, api, prom, token, run, json.loads(out.splitlines()[0]))
    finally:
        stack.close()  # Prometheus first: it scrapes serve
        if procs:
            stop(procs[0])
        rt.close()


def _ledger_calls(s: Scraped, decision: str) -> int:
    """The run's call decisions in the ledger (its own, not its start and end)."""
    calls = ("sql.select", "file.read", "file.write")
    events = [json.loads(e) for e in s.gov.rt.ledger.entries("acme")]
    return sum(1 for e in events if e.get("run") == s.run["id"] and e["action"] in calls
               and e["decision"] == decision)  # fmt: skip


def test_promql_counts_the_jobs_calls_as_the_ledger_records_them(scraped: Scraped) -> None:
    s = scraped
    assert s.stdout == {"sql": 2, "write": 7, "read": "metered", "denied": 2}
    denied, allowed = _ledger_calls(s, "deny"), _ledger_calls(s, "allow")
    assert (denied, allowed) == (2, 3)
    # Through Prometheus: what the runtime counted equals what the ledger holds.
    s.until('sum(proctor_calls_total{job="proctor", decision="deny"})', denied)
    s.until('sum(proctor_calls_total{job="proctor", tenant="acme", kind="file.write",'
            ' decision="deny"})', denied)  # fmt: skip
    s.until('sum(proctor_calls_total{job="proctor", tenant="acme", kind="sql",'
            ' decision="allow"})', 1)  # fmt: skip
    s.until('sum(proctor_rate_limit_refusals_total{job="proctor"}) or vector(0)', 0)


def test_promql_counts_the_run_and_the_api_request_that_started_it(scraped: Scraped) -> None:
    s = scraped
    s.until('sum(proctor_runs_finished_total{job="proctor", outcome="succeeded",'
            f' backend="{BACKEND}"}})', 1)  # fmt: skip
    s.until('sum(proctor_runs{job="proctor"})', 0)  # none starting or running now
    route = "/tenants/{tenant}/deployments/{name}/runs"
    s.until(f'sum(proctor_api_requests_total{{job="proctor", method="POST", route="{route}",'
            ' status="200"})', 1)  # fmt: skip
    s.until(f'sum(proctor_api_request_duration_seconds_count{{job="proctor", route="{route}"}})',
            1)  # fmt: skip
    # The API's own /metrics, scraped with the token from the file serve reads.
    s.until('up{job="proctor-api"}', 1)
    s.until('up{job="proctor"}', 1)
    s.until('count(proctor_build_info{job="proctor-api"})', 1)
    # No tenant's name where tenant labels are not given, even with them on.
    assert s.query('count(proctor_api_requests_total{route=~".*acme.*"})') is None


def test_the_apis_metrics_refuse_a_scrape_without_the_token(scraped: Scraped) -> None:
    s = scraped
    assert httpx.get(f"{s.api}/metrics", timeout=10).status_code == 401
    admin = {"Authorization": f"Bearer {s.gov.token('root')}"}
    assert httpx.get(f"{s.api}/metrics", headers=admin, timeout=10).status_code == 401
    ok = httpx.get(f"{s.api}/metrics", headers={"Authorization": f"Bearer {s.token}"},
                   timeout=10)  # fmt: skip
    assert ok.status_code == 200 and "proctor_calls_total" in ok.text
    # No scrape was recorded: Prometheus has scraped the API every second meanwhile.
    events = [json.loads(e) for e in s.gov.rt.ledger.entries("system")]
    assert not [e for e in events if "/metrics" in json.dumps(e)]


def test_a_serve_without_the_api_serves_its_metrics_alone(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    gov = build_gov(tmp_path)
    gov.rt.close()
    # Options that would be ignored are refused, one line each, nothing started.
    for args, words in ((["--no-api", "--metrics-token-file", str(tmp_path / "t")],
                         "--metrics-token-file is for the HTTP API"),
                        (["--metrics-host", "0.0.0.0"], "--metrics-host is the address of"),
                        (["--metrics-port", "0"], "--metrics-port")):  # fmt: skip
        res = run_cli("serve", *args, home=gov.home, check=False)
        assert res.code == 2 and words in res.err, res.err
    port = free_port()
    env = dict(os.environ, PROCTOR_HOME=str(gov.home))
    log = tmp_path / "serve.stderr"
    with log.open("wb") as err:
        serve = subprocess.Popen([PROCTOR, "serve", "--backend", BACKEND, "--no-api",
                                  "--metrics-port", str(port)], env=env,
                                 stdout=subprocess.PIPE, stderr=err)  # fmt: skip
    try:

        def scraped() -> str:
            if serve.poll() is not None:
                return "ended"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.HTTPError:
                return ""

        text = wait_until(scraped, "the metrics port")
        assert "proctor_build_info" in text and "proctor_runs_finished_total" in text
        # No API: no request of it is counted.
        assert "proctor_api_requests_total{" not in text
        # Stopped once it serves (its signal handlers are set then).
        wait_until(lambda: b'"node.join"' in log.read_bytes(), "serve's node")
    finally:
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=60)
    assert serve.returncode == 0
    assert f"metrics at http://127.0.0.1:{port}/metrics" in out.decode()
