"""The API's ``/metrics`` and what the API counts, against the real server on loopback.

The scrape needs the operator's token (a tenant's admin is refused: the metrics are
every tenant's); the route label is the route's template, never the path (which
holds tenants' names and ids), and a made-up method is one series, not one each.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proctor.api import serve_api
from proctor.errors import UsageError
from tests.integration.test_api_support import ApiEnv, build_env


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiEnv, str]]:
    tmp = tmp_path_factory.mktemp("api-metrics")
    api = build_env(tmp)
    token = secrets.token_hex(32)
    (tmp / "scrape.token").write_text(token + "\n")
    # A second server over the same runtime, the one that serves metrics.
    api.server.stop()
    api.server = serve_api(api.rt, "127.0.0.1", 0, metrics_token_file=tmp / "scrape.token")
    yield api, token
    api.server.stop()
    api.rt.close()


def _scrape(api: ApiEnv, token: str, accept: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"}
    if accept is not None:
        headers["Accept"] = accept
    return httpx.get(f"{api.url}/metrics", headers=headers, timeout=30)


def _sample(text: str, name: str) -> float:
    """The value of an unlabelled sample."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split(" ")[1])


def _api_series(text: str) -> str:
    """The API's own series (the process's metrics hold other tests' too, some with
    tenant labels another test turned on)."""
    return "\n".join(line for line in text.splitlines()
                     if line.startswith("proctor_api_") or (line.startswith(
                         "proctor_rate_limit_") and 'surface="api"' in line))  # fmt: skip


def _count(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name) : line.rindex("}") + 1]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_scrape_needs_the_operators_token_not_a_principals(env: tuple[ApiEnv, str]) -> None:
    api, token = env
    assert httpx.get(f"{api.url}/metrics", timeout=30).status_code == 401
    # A tenant's admin, whose token opens everything of its own tenant: refused.
    refused = _scrape(api, api.token("acme", "root"))
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "unauthenticated"
    assert "proctor_" not in refused.text
    assert _scrape(api, token[:-1] + ("0" if token[-1] != "0" else "1")).status_code == 401
    ok = _scrape(api, token)
    assert ok.status_code == 200
    assert ok.headers["content-type"].startswith("text/plain")
    assert "proctor_api_requests_total" in ok.text
    assert "proctor_build_info" in ok.text
    # The scrape's own connection is one the API holds.
    assert _sample(ok.text, "proctor_api_connections") >= 1
    om = _scrape(api, token, "application/openmetrics-text; version=1.0.0")
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")


def test_no_scrape_is_recorded_in_the_ledger(env: tuple[ApiEnv, str]) -> None:
    api, token = env
    before = {t: len(api.events(t)) for t in ("acme", "globex", "system")}
    for _ in range(5):
        assert _scrape(api, token).status_code == 200
    assert {t: len(api.events(t)) for t in before} == before


def test_a_route_is_labelled_by_its_template_never_its_path(env: tuple[ApiEnv, str]) -> None:
    api, token = env
    with api.http("acme", "root") as http:
        assert http.get("/tenants/acme/runs").status_code == 200
        # Another tenant's runs: 404, as for a tenant that does not exist.
        assert http.get("/tenants/globex/runs").status_code == 404
        assert http.get("/tenants/acme/runs?deployment=nightly-7f3a").status_code == 200
        assert http.get("/no-such-route-d41d8c/tenants/acme").status_code == 404
    text = _scrape(api, token).text
    mine = _api_series(text)
    route = "/tenants/{tenant}/runs"
    assert _count(text, "proctor_api_requests_total", method="GET", route=route,
                  status="200") >= 2  # fmt: skip
    assert _count(text, "proctor_api_requests_total", method="GET", route=route,
                  status="404") >= 1  # fmt: skip
    assert _count(text, "proctor_api_requests_total", route="unmatched", status="404") >= 1
    assert _count(text, "proctor_api_request_duration_seconds_count", route=route) >= 3
    # Tenant labels are off: no tenant's name, no path, no query anywhere.
    for leak in ("acme", "globex", "d41d8c", "nightly-7f3a", "/no-such-route"):
        assert leak not in mine, leak


def test_a_made_up_method_is_one_series(env: tuple[ApiEnv, str]) -> None:
    api, token = env
    for i in range(3):
        httpx.request(f"BREW{i}X", f"{api.url}/key", timeout=30)
    text = _scrape(api, token).text
    assert "BREW" not in text
    assert _count(text, "proctor_api_requests_total", method="OTHER", route="/key") >= 3


def test_an_api_without_a_scrape_token_serves_no_metrics(tmp_path: Path) -> None:
    api = build_env(tmp_path)
    try:
        got = httpx.get(f"{api.url}/metrics", headers={"Authorization": "Bearer " + "x" * 40})
        assert got.status_code == 404
        assert "--metrics-token-file" in (got.json()["error"]["hint"] or "")
    finally:
        api.server.stop()
        api.rt.close()


def test_a_short_or_unreadable_token_file_is_refused(env: tuple[ApiEnv, str], tmp_path: Path
                                                     ) -> None:  # fmt: skip
    api, _ = env
    (tmp_path / "short").write_text("letmein\n")
    with pytest.raises(UsageError, match="shorter than 32"):
        serve_api(api.rt, "127.0.0.1", 0, metrics_token_file=tmp_path / "short")
    with pytest.raises(UsageError, match="cannot read the metrics token file"):
        serve_api(api.rt, "127.0.0.1", 0, metrics_token_file=tmp_path / "missing")


def test_a_principal_over_its_budget_is_counted_as_an_api_refusal(tmp_path: Path) -> None:
    from proctor.api import Limits

    api = build_env(tmp_path)
    token = secrets.token_hex(32)
    (tmp_path / "t").write_text(token)
    api.server.stop()
    api.server = serve_api(api.rt, "127.0.0.1", 0, metrics_token_file=tmp_path / "t",
                           limits=Limits(requests_per_second=0.01, request_burst=2))  # fmt: skip
    try:
        name = "proctor_rate_limit_refusals_total"
        before = _count(_scrape(api, token).text, name, surface="api", reason="rate")
        with api.http("globex", "dev") as http:
            codes = [http.get("/tenants/globex/runs").status_code for _ in range(5)]
        assert codes == [200, 200, 429, 429, 429]
        text = _scrape(api, token).text
        assert _count(text, name, surface="api", reason="rate", tenant="") == before + 3
        assert _count(text, "proctor_api_requests_total", route="/tenants/{tenant}/runs",
                      status="429") >= 3  # fmt: skip
        assert "globex" not in _api_series(text)
    finally:
        api.server.stop()
        api.rt.close()


def test_the_consoles_routes_are_templates_under_its_mount(tmp_path: Path) -> None:
    from proctor.console import ConsoleConfig

    api = build_env(tmp_path)
    token = secrets.token_hex(32)
    (tmp_path / "t").write_text(token)
    api.server.stop()
    api.server = serve_api(api.rt, "127.0.0.1", 0, metrics_token_file=tmp_path / "t",
                           console=ConsoleConfig())  # fmt: skip
    try:
        routes = ("/ui/t/{tenant}/runs", "/ui/static/{name}", "/ui/signin")
        # The process's metrics outlive a test (other tests' console requests count
        # too): this request's own, as a difference.
        before = _scrape(api, token).text
        for path in ("/ui/t/globex/runs", "/ui/static/x-9c1e.css", "/ui/signin"):
            httpx.get(f"{api.url}{path}", timeout=30)
        text = _scrape(api, token).text
        for route in routes:
            counted = _count(text, "proctor_api_requests_total", route=route)
            assert counted - _count(before, "proctor_api_requests_total", route=route) == 1, route
        assert "globex" not in _api_series(text) and "9c1e" not in _api_series(text)
    finally:
        api.server.stop()
        api.rt.close()
