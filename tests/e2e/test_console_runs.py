"""Issue 18, runs in the console: a real sandbox run seen in a real browser while it
runs (its output arrives on the page without a reload), its calls with refusals
first, the artifact page showing what its sandbox runs did, and a deployment
stopped by an admin but not by a developer."""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proctor.api import ApiServer, serve_api
from proctor.client import Client
from proctor.console import ConsoleConfig
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import working

playwright_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
BACKEND = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[0]
SHOTS = Path(__file__).resolve().parents[2] / "build" / "console-screenshots"

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium (make setup)"),
]

JOB = """\
import os, sys, time
import proctor_guest
print("first line", flush=True)
rows = proctor_guest.sql("fake", "SELECT id FROM customers WHERE id <= 2")["rows"]
try:
    proctor_guest.sql("fake", "SELECT email FROM customers")
except Exception as exc:
    print("refused:", type(exc).__name__, flush=True)
# Wait for the test to have the page open (a file the test writes into the bucket
# tree is not visible here; a fixed pause is what a real job's work looks like).
time.sleep(6)
print("second line after", len(rows), "rows", flush=True)
"""
CAPS = """\
[datasets.fake.tables.customers]
columns = ["id", "country"]
access = "read"
[buckets]
reports = "write"
"""


@dataclass
class Env:
    gov: Gov
    server: ApiServer
    digest: str

    @property
    def url(self) -> str:
        return self.server.url + "/ui"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    gov = build_gov(tmp_path_factory.mktemp("console-runs"))
    digest = gov.submit("acme", gov.artifact_dir("slow", JOB, CAPS), "dev")
    server = serve_api(gov.rt, "127.0.0.1", 0, backend=BACKEND, console=ConsoleConfig())
    SHOTS.mkdir(parents=True, exist_ok=True)
    with Client(server.url, gov.token("dev")) as c:
        c.deploy("acme", digest, "slow", instruction="console run test")
    try:
        yield Env(gov, server, digest)
    finally:
        server.stop()
        gov.rt.close()


def _signed_in(browser: Any, env: Env, who: str) -> Any:
    page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
    page.set_default_timeout(30_000)
    page.goto(env.url + "/signin")
    page.fill("#token", env.gov.token(who))
    page.click("form[action$='/signin'] button[type=submit]")
    page.wait_for_url(re.compile(r".*/ui/t/acme/$"))
    return page


def test_a_running_runs_output_calls_and_the_artifacts_observed_calls(env: Env) -> None:
    done: dict[str, Any] = {}

    def start() -> None:
        with Client(env.server.url, env.gov.token("dev")) as c:
            done["run"] = c.run("acme", "slow")

    runner = threading.Thread(target=start)
    runner.start()
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = _signed_in(browser, env, "dev")
            # The live output is htmx swapping partials in: under the console's CSP,
            # which Chromium reports on the console whenever it blocks anything.
            violations: list[str] = []
            page.on("console", lambda m: violations.append(m.text)
                    if "Content Security Policy" in m.text else None)  # fmt: skip
            # The run appears in the list while it runs.
            for _ in range(100):
                page.goto(env.url + "/t/acme/runs")
                if page.locator("tbody tr").count():
                    break
                page.wait_for_timeout(200)
            page.locator("tbody tr td a").first.click()
            page.wait_for_selector("#run-output")
            page.wait_for_function(
                "() => document.querySelector('#run-output').innerText.includes('first line')"
            )
            assert "second line" not in page.inner_text("#run-output")
            # Without a reload, the page polls and the rest of the output arrives.
            page.wait_for_function(
                "() => document.querySelector('#run-output').innerText.includes('second line')",
                timeout=60_000,
            )
            runner.join(60)
            assert done["run"]["status"] == "succeeded", done
            assert not violations, violations
            # The listener hears what the policy blocks: an inline script is refused.
            page.evaluate("""() => { const s = document.createElement('script');
                s.textContent = 'window.__ran = 1'; document.body.appendChild(s); }""")
            page.wait_for_timeout(200)
            assert violations and page.evaluate("() => window.__ran") is None, violations
            page.reload()
            rows = page.locator("#calls ~ div tbody tr")
            assert rows.count() >= 2
            first = rows.first.inner_text()
            assert "deny" in first and "email" in first, first
            assert "1 refused" in page.inner_text("#calls")
            page.screenshot(path=str(SHOTS / "run-finished.png"), full_page=True)
            # The approver's page of this digest shows what its sandbox run did.
            approver = _signed_in(browser, env, "alice")
            approver.goto(f"{env.url}/t/acme/artifacts/{env.digest}")
            observed = approver.inner_text("#observed ~ h3") if approver.locator(
                "#observed ~ h3").count() else approver.inner_text("main")  # fmt: skip
            assert "1 refused" in observed, observed
            assert "bucket reports" in approver.inner_text("main")  # declared, never used
            approver.screenshot(path=str(SHOTS / "artifact-observed.png"), full_page=True)
        finally:
            browser.close()
            runner.join(60)


def test_an_admin_stops_a_deployment_and_an_approver_may_not(env: Env) -> None:
    # The page asks the API, which decides as for the CLI: stopping takes the right to
    # deploy (a developer's, an operator's, an admin's), which an approver lacks.
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            dev = _signed_in(browser, env, "alice")
            dev.goto(env.url + "/t/acme/deployments")
            dev.fill("input[name=reason]", "I want it gone")
            dev.click("button:has-text('Stop')")
            dev.wait_for_selector(".flash")
            assert dev.locator(".flash.error").count() == 1, dev.inner_text("main")
            assert env.gov.rt.deployments.get("acme", "slow").status != "stopped"
            root = _signed_in(browser, env, "root")
            root.goto(env.url + "/t/acme/deployments")
            root.fill("input[name=reason]", "end of the quarter")
            root.click("button:has-text('Stop')")
            root.wait_for_selector(".flash.ok")
            assert env.gov.rt.deployments.get("acme", "slow").status == "stopped"
        finally:
            browser.close()
