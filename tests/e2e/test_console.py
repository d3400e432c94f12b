"""Issue 18: the web console, driven in a real browser (Debian's Chromium through
Playwright) against a real `serve_api` on loopback and a real OIDC provider
(`oidc-provider-mock`, authorization code flow, a registered client with a
secret). Every click is checked where it lands: in the ledger.

Screenshots of every page (1280x800 and a phone's 390x844) are written to
build/console-screenshots/ and every page is checked with axe-core."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from proctor.api import ApiServer, OIDCIssuer, serve_api
from proctor.console import ConsoleConfig
from tests.e2e.conftest_gov import Gov, build_gov
from tests.integration.test_api_support import self_signed

playwright_api = pytest.importorskip("playwright.sync_api")
oidc_mock = pytest.importorskip("oidc_provider_mock")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[2] / "build" / "console-screenshots"
# What the probe of this machine found Chromium needs on a closed network.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
SECRET_LINE = "RATE = 0.0421  # the line an approver must be able to read"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium (make setup)")


@dataclass
class Env:
    gov: Gov
    server: ApiServer
    issuer: str
    digest: str  # by dev, waiting for approvers
    own: str  # by bob (an approver): bob may not approve it
    shots: Path

    @property
    def url(self) -> str:
        return self.server.url + "/ui"

    def approvals(self, digest: str) -> list[Any]:
        return self.gov.rt.approvals.for_artifact("acme", digest)

    def events(self, action_prefix: str) -> list[dict[str, Any]]:
        out = []
        for raw in self.gov.rt.ledger.events_between("acme", since="2000-01-01T00:00:00Z"):
            ev = json.loads(raw)
            if str(ev["action"]).startswith(action_prefix):
                out.append(ev)
        return out


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("console")
    gov = build_gov(tmp)
    op = gov.rt.operator
    for name, roles in (("carol", ["approver"]), ("audrey", ["auditor"])):
        p, tok = gov.rt.principals.create("acme", name, "user", roles, op)
        gov.people[name] = (p, tok)
    art = gov.artifact_dir(
        "churn", f"import json\n{SECRET_LINE}\nprint(json.dumps({{'rate': RATE}}))\n",
        '[datasets.fake.tables.customers]\ncolumns = ["id", "country"]\naccess = "read"\n'
        '[buckets]\nreports = "write"\n',
    )  # fmt: skip
    gov.rt.subprocessors.add("acme", "benchmarks-inc", purpose="churn benchmarks",
                             location="EU", hosts=["api.bench.example:443"],
                             actor=gov.rt.operator)  # fmt: skip
    digest = gov.submit("acme", art, "dev")
    own = gov.submit("acme", gov.artifact_dir("bobs", "print('mine')\n"), "bob")
    with oidc_mock.run_server_in_thread(port=0, require_client_registration=True) as idp:
        issuer = f"http://localhost:{idp.server_port}"
        # The console is a registered client: exact redirect URI, a client secret.
        reserved = serve_api(gov.rt, "127.0.0.1", 0)
        port = reserved.port
        reserved.stop()
        callback = f"http://127.0.0.1:{port}/ui/oidc/callback"
        reg = httpx.post(f"{issuer}/oauth2/clients", json={"redirect_uris": [callback]}).json()
        secret_file = tmp / "console-secret"
        secret_file.write_text(reg["client_secret"])
        oidc = [OIDCIssuer(issuer=issuer, audience=reg["client_id"], tenant="acme",
                           jwks_url=f"{issuer}/jwks", console=True,
                           console_client_secret=reg["client_secret"],
                           console_label="Example SSO")]  # fmt: skip
        server = serve_api(gov.rt, "127.0.0.1", port, oidc=oidc, console=ConsoleConfig())
        SHOTS.mkdir(parents=True, exist_ok=True)
        try:
            yield Env(gov, server, issuer, digest, own, SHOTS)
        finally:
            server.stop()
            gov.rt.close()


@pytest.fixture(scope="module")
def browser(env: Env) -> Iterator[Any]:
    with playwright_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _page(browser: Any, **kw: Any) -> Any:
    kw.setdefault("viewport", {"width": 1280, "height": 800})
    ctx = browser.new_context(**kw)
    page = ctx.new_page()
    page.set_default_timeout(20_000)
    return page


def _token_sign_in(env: Env, browser: Any, who: str, **kw: Any) -> Any:
    page = _page(browser, **kw)
    page.goto(env.url + "/")
    page.fill("#token", env.gov.token(who))
    page.click("form[action$='/signin'] button[type=submit]")
    page.wait_for_url(re.compile(r".*/ui/t/acme/$"))
    return page


def _flash(page: Any) -> str:
    return str(page.locator(".flash").all_inner_texts())


# -- sign-in through a real OIDC provider, read, approve ------------------------------


def test_an_approver_signs_in_with_oidc_reads_a_file_and_approves(env: Env, browser: Any) -> None:
    page = _page(browser)
    page.goto(env.url + "/")
    page.click("text=Sign in with Example SSO")
    # The identity provider's own page: who is signing in.
    page.wait_for_load_state()
    assert page.url.startswith(env.issuer + "/oauth2/authorize"), (
        page.url,
        page.inner_text("body")[:500],
    )
    assert "code_challenge_method=S256" in page.url and "code_challenge=" in page.url
    page.fill("input[name=sub]", "carol")
    page.click("button:has-text('Authorize')")
    page.wait_for_url(re.compile(r".*/ui/t/acme/$"))
    assert "carol" in page.inner_text("header")
    # The queue holds dev's artifact, not bob's own (bob's waits for others too).
    page.click("nav >> text=Approvals")
    queue = page.inner_text("main")
    assert "churn" in queue
    page.click(f"a[href$='/artifacts/{env.digest.replace(':', '%3A')}']")
    # The file's content, as text on the page, and the capabilities in words.
    assert SECRET_LINE.split("#", maxsplit=1)[0].strip() in page.inner_text("main")
    caps = page.inner_text("#caps + ul")
    assert "fake.customers" in caps and "columns country, id" in caps
    assert "bucket reports" in caps
    page.fill("#comment", "read main.py; fine")
    page.click("button:has-text('Approve')")
    page.wait_for_selector(".flash")
    assert page.locator(".flash.ok").count() == 1, _flash(page)
    assert "approved as acme/carol" in _flash(page)
    assert "1 live approval" in page.inner_text("#decide ~ p") or "1 live approval" in (
        page.inner_text("main")
    )
    page.screenshot(path=str(env.shots / "artifact-approved.png"), full_page=True)
    # The ledger holds it, attributed to the person signed in, exactly as the CLI's.
    mine = [a for a in env.approvals(env.digest) if a.principal == "acme/carol"]
    assert len(mine) == 1 and mine[0].decision == "approve"
    assert mine[0].comment == "read main.py; fine"
    recorded = [e for e in env.events("approval.") if e.get("decision") == "allow"
                and "carol" in json.dumps(e.get("actor"))]  # fmt: skip
    assert recorded, "no approval event attributed to carol"
    page.context.close()


def test_the_authors_own_approval_is_refused_on_the_page(env: Env, browser: Any) -> None:
    page = _token_sign_in(env, browser, "bob")
    page.goto(f"{env.url}/t/acme/artifacts/{env.own}")
    assert "You are this artifact's author" in page.inner_text("main")
    page.click("button:has-text('Approve')")
    page.wait_for_selector(".flash.error")
    assert "not approved" in _flash(page)
    assert "author" in _flash(page).lower() or "separation" in _flash(page).lower()
    assert env.approvals(env.own) == []
    page.context.close()


# -- the auditor --------------------------------------------------------------------


def test_an_auditor_checks_an_events_proof_in_the_page(env: Env, browser: Any) -> None:
    auth = {"Authorization": f"Bearer {env.gov.token('audrey')}"}
    kept = httpx.get(f"{env.server.url}/tenants/acme/log/checkpoint", headers=auth).text
    env.gov.rt.resources.add_bucket("acme", "scratch", env.gov.rt.operator)  # the log grows
    page = _token_sign_in(env, browser, "audrey")
    page.click("nav >> text=Audit")
    page.wait_for_selector("table")
    first = page.locator("tbody tr td a").first
    seq = int(first.inner_text())
    first.click()
    page.wait_for_url(re.compile(rf".*/audit/{seq}$"))
    section = page.locator("section[data-proof=inclusion]")
    section.locator("button[data-verify]").click()
    result = section.locator("[data-result]")
    page.wait_for_function("el => el.dataset.outcome", arg=result.element_handle(), timeout=10_000)
    assert result.get_attribute("data-outcome") == "ok", result.inner_text()
    assert "nothing but the verifier key" in result.inner_text()
    page.screenshot(path=str(env.shots / "event-proof-verified.png"), full_page=True)
    # Against another key, the same check fails: the page trusts the key, not the server.
    other = _other_vkey(env)
    section.locator("[data-field=vkey]").fill(other)
    section.locator("button[data-verify]").click()
    page.wait_for_function("el => el.dataset.outcome === 'fail'", arg=result.element_handle())
    # Consistency with a checkpoint the auditor kept from before the log grew.
    cons = page.locator("section[data-proof=consistency]")
    cons.locator("[data-field=old-checkpoint]").fill(kept)
    cons.locator("button[data-verify]").click()
    cres = cons.locator("[data-result]")
    page.wait_for_function("el => el.dataset.outcome", arg=cres.element_handle())
    assert cres.get_attribute("data-outcome") == "ok", cres.inner_text()
    page.context.close()


def _other_vkey(env: Env) -> str:
    from proctor.ledger import Signer

    name = env.gov.rt.ledger.vkey().split("+")[0]
    return Signer.generate(name).verifier.vkey()


def test_an_auditors_session_cannot_approve(env: Env, browser: Any) -> None:
    page = _token_sign_in(env, browser, "audrey")
    page.goto(f"{env.url}/t/acme/artifacts/{env.digest}")
    before = len(env.approvals(env.digest))
    page.click("button:has-text('Approve')")
    page.wait_for_selector(".flash.error")
    assert "may not" in _flash(page)
    assert len(env.approvals(env.digest)) == before
    page.context.close()


def test_another_tenants_pages_answer_404(env: Env, browser: Any) -> None:
    page = _token_sign_in(env, browser, "alice")
    for path in ("/", "/approvals", f"/artifacts/{env.digest}", "/audit", "/runs", "/resources"):
        resp = page.goto(f"{env.url}/t/globex{path}")
        assert resp.status == 404, path
        assert "Not found" in page.inner_text("h1")
    page.context.close()


# -- sessions, CSRF and headers (no browser needed: the attacker has none either) -----


def _signed_in(env: Env, who: str, base: str | None = None) -> httpx.Client:
    c = httpx.Client(base_url=base or env.url, follow_redirects=True)
    form = c.get("/signin").text
    csrf = re.search(r'name="csrf" value="([^"]+)"', form)
    assert csrf
    r = c.post("/signin", data={"csrf": csrf.group(1), "token": env.gov.token(who)})
    assert r.status_code == 200 and "/t/acme/" in str(r.url), r.text[:300]
    return c


def _csrf(c: httpx.Client, path: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', c.get(path).text)
    assert found
    return found.group(1)


def test_a_form_without_its_csrf_token_changes_nothing(env: Env) -> None:
    c = _signed_in(env, "alice")
    target = f"/t/acme/artifacts/{env.digest}/approve"
    before = len(env.approvals(env.digest))
    for data in ({}, {"csrf": "forged"}, {"csrf": ""}):
        r = c.post(target, data={**data, "expires_days": "30"})
        assert r.status_code == 403 and "CSRF" in r.text
    # A cross-site post with the right token is still refused by its Origin.
    token = _csrf(c, f"/t/acme/artifacts/{env.digest}")
    r = c.post(target, data={"csrf": token}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    assert len(env.approvals(env.digest)) == before
    # The sign-in form is protected as well (no login CSRF).
    fresh = httpx.Client(base_url=env.url)
    r = fresh.post("/signin", data={"token": env.gov.token("alice")})
    assert r.status_code == 403


def test_forged_expired_and_signed_out_sessions_are_refused(env: Env) -> None:
    forged = httpx.Client(base_url=env.url, cookies={"proctor_session": "x" * 43})
    r = forged.get("/t/acme/approvals")
    assert r.status_code == 303 and "/signin" in r.headers["location"]
    r = forged.post(f"/t/acme/artifacts/{env.digest}/approve", data={"csrf": "x"})
    assert r.status_code == 401
    # Signed out: the same cookie opens nothing any more.
    c = _signed_in(env, "alice")
    cookie = c.cookies["proctor_session"]
    token = _csrf(c, "/t/acme/")
    c.post("/signout", data={"csrf": token})
    replay = httpx.Client(base_url=env.url, cookies={"proctor_session": cookie})
    assert replay.get("/t/acme/").status_code == 303
    # Expired: a console whose sessions idle out after a second.
    short = serve_api(env.gov.rt, "127.0.0.1", 0, console=ConsoleConfig(idle_seconds=1.0))
    try:
        s = _signed_in(env, "alice", base=short.url + "/ui")
        assert s.get("/t/acme/").status_code == 200
        time.sleep(1.5)
        r = s.get("/t/acme/", follow_redirects=False)
        assert r.status_code == 303 and "/signin" in r.headers["location"]
    finally:
        short.stop()


def test_cookies_and_headers_hold_the_browser_to_the_rules(env: Env) -> None:
    c = httpx.Client(base_url=env.url)
    form = c.get("/signin")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert csrf
    r = c.post("/signin", data={"csrf": csrf.group(1), "token": env.gov.token("alice")})
    assert r.status_code == 303
    cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith("proctor_session="))
    low = cookie.lower()
    assert "httponly" in low and "samesite=strict" in low and "path=/ui/" in low
    assert "secure" not in low  # plain HTTP here; under TLS it is Secure (next test)
    page = c.get("/t/acme/approvals")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "frame-ancestors 'none'" in csp
    assert page.headers["cache-control"] == "no-store"
    # No inline script or style anywhere in the markup.
    assert "<script>" not in page.text and " style=" not in page.text and "onclick" not in page.text
    # A bad token never opens a session, and says why without echoing it.
    c2 = httpx.Client(base_url=env.url)
    csrf2 = re.search(r'name="csrf" value="([^"]+)"', c2.get("/signin").text)
    assert csrf2
    r = c2.post("/signin", data={"csrf": csrf2.group(1), "token": "pt_wrong"})
    assert r.status_code == 401 and "pt_wrong" not in r.text
    assert "proctor_session" not in c2.cookies


def test_under_tls_the_session_cookie_is_secure(env: Env, tmp_path: Path) -> None:
    certfile, keyfile = self_signed(tmp_path)
    tls = serve_api(env.gov.rt, "127.0.0.1", 0, certfile=certfile, keyfile=keyfile,
                    console=ConsoleConfig())  # fmt: skip
    try:
        c = httpx.Client(base_url=tls.url + "/ui", verify=str(certfile))
        csrf = re.search(r'name="csrf" value="([^"]+)"', c.get("/signin").text)
        assert csrf
        r = c.post("/signin", data={"csrf": csrf.group(1), "token": env.gov.token("alice")})
        cookie = next(h for h in r.headers.get_list("set-cookie")
                      if h.startswith("proctor_session="))  # fmt: skip
        assert "secure" in cookie.lower()
    finally:
        tls.stop()


# -- every page: accessible, usable at 1280x800 and on a phone, readable without JS ---


def _pages(env: Env) -> list[tuple[str, str]]:
    seq = 1
    return [
        ("home", "/t/acme/"), ("approvals", "/t/acme/approvals"),
        ("artifacts", "/t/acme/artifacts"), ("artifact", f"/t/acme/artifacts/{env.digest}"),
        ("deployments", "/t/acme/deployments"), ("runs", "/t/acme/runs"),
        ("audit", "/t/acme/audit"), ("event", f"/t/acme/audit/{seq}"),
        ("history", "/t/acme/history?at=2026-01-01T00:00"), ("tenant", "/t/acme/resources"),
        ("bucket", "/t/acme/buckets/reports"),
    ]  # fmt: skip


def test_every_page_passes_axe_at_desktop_and_phone_width(env: Env, browser: Any) -> None:
    from axe_playwright_python.sync_playwright import Axe

    axe = Axe()
    problems = []
    for label, viewport in (("desktop", (1280, 800)), ("phone", (390, 844))):
        page = _token_sign_in(env, browser, "root",
                              viewport={"width": viewport[0], "height": viewport[1]})  # fmt: skip
        targets = [("signin", None), *_pages(env)]
        for name, path in targets:
            if path is None:
                anon = _page(browser, viewport={"width": viewport[0], "height": viewport[1]})
                anon.goto(env.url + "/signin")
                current = anon
            else:
                resp = page.goto(env.url + path)
                assert resp.status == 200, (name, resp.status, page.inner_text("main")[:300])
                current = page
            results = axe.run(current)
            for v in results.response["violations"]:
                if v["impact"] in ("serious", "critical"):
                    problems.append(f"{label} {name}: {v['id']} ({v['impact']}) "
                                    f"{[n['target'] for n in v['nodes']][:3]}")  # fmt: skip
            # No page is wider than the screen: wide tables scroll inside their box.
            overflow = current.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 1, f"{label} {name} is {overflow}px wider than the screen"
            current.screenshot(path=str(env.shots / f"{name}-{label}.png"), full_page=True)
            if current is not page:
                current.context.close()
        page.context.close()
    assert not problems, "\n".join(problems)


def test_pages_read_without_javascript(env: Env, browser: Any) -> None:
    page = _token_sign_in(env, browser, "root", java_script_enabled=False)
    page.goto(f"{env.url}/t/acme/artifacts/{env.digest}")
    assert SECRET_LINE.split("#", maxsplit=1)[0].strip() in page.inner_text("main")
    page.goto(f"{env.url}/t/acme/audit")
    assert page.locator("tbody tr").count() > 0
    page.context.close()


def test_the_console_adds_no_api_path(env: Env) -> None:
    from proctor.api import openapi_document

    paths = openapi_document()["paths"]
    assert not [p for p in paths if p.startswith("/ui")]
    # What the console may import is held by tests/unit/test_layering.py: the SDK
    # and the errors, nothing that could decide or record on its own.


def test_subprocessors_show_to_whom_the_api_shows_them(env: Env, browser: Any) -> None:
    # Read through the API's own path (GET /tenants/{t}/subprocessors), as the audit
    # log is: an auditor sees the processor, a developer sees that the role does not.
    aud = _token_sign_in(env, browser, "audrey")
    aud.goto(f"{env.url}/t/acme/resources")
    section = aud.locator("section[aria-labelledby=sp]").inner_text()
    assert "benchmarks-inc" in section and "api.bench.example:443" in section, section
    aud.context.close()
    dev = _token_sign_in(env, browser, "dev")
    dev.goto(f"{env.url}/t/acme/resources")
    section = dev.locator("section[aria-labelledby=sp]").inner_text()
    assert "benchmarks-inc" not in section and "does not show" in section, section
    dev.context.close()


def test_an_auditor_downloads_an_evidence_pack_that_verifies(
    env: Env, browser: Any, tmp_path: Path
) -> None:
    from proctor.evidence import verify_pack

    page = _token_sign_in(env, browser, "audrey", accept_downloads=True)
    page.goto(f"{env.url}/t/acme/audit")
    page.fill("#e-from", "2000-01-01")
    page.fill("#e-to", "2100-01-01")
    with page.expect_download() as got:
        page.click("button:has-text('Download the evidence pack')")
    dest = tmp_path / "pack.zip"
    got.value.save_as(str(dest))
    # Checked offline against the key the auditor holds, not the pack's own.
    assert verify_pack(dest, env.gov.rt.ledger.vkey()).events > 0
    page.context.close()


def test_signing_in_never_redirects_off_the_console(env: Env) -> None:
    # "next" is where a sign-in lands: only a path of the console. A browser drops a
    # tab or newline from a URL, so "/\t/evil.example" would become "//evil.example".
    home = "/ui/t/acme/"
    for nxt, lands in (
        ("/ui/t/acme/audit", "/ui/t/acme/audit"),
        ("//evil.example/x", home),
        ("/\t/evil.example/x", home),
        ("/\n/evil.example/x", home),
        ("/\\evil.example/x", home),
        ("https://evil.example/", home),
        ("/tenants/acme/events", home),  # the API's, not a page of the console
    ):
        c = httpx.Client(base_url=env.url)
        form = c.get("/signin", params={"next": nxt})
        csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
        assert csrf
        r = c.post("/signin", params={"next": nxt},
                   data={"csrf": csrf.group(1), "token": env.gov.token("alice"), "next": nxt})  # fmt: skip
        assert r.status_code == 303, (nxt, r.text[:200])
        assert r.headers["location"] == lands, (nxt, r.headers["location"])


def test_the_audit_page_filters_by_actor_on_the_server(env: Env) -> None:
    # Every row is the asked actor's, however far back in the log they are.
    _signed_in(env, "alice").get("/t/acme/approvals")  # events by acme/alice
    page = _signed_in(env, "audrey").get("/t/acme/audit", params={"actor": "acme/alice"}).text
    rows = re.findall(r"<tr class=\"(?:allow|deny)\">(.*?)</tr>", page, re.S)
    actors = {re.findall(r"<td>(.*?)</td>", r, re.S)[2] for r in rows}
    assert rows and actors == {"acme/alice"}, actors


# -- attacks on the seams: the browser, the identity provider, the API behind ------------


def test_a_planted_session_cookie_is_never_adopted(env: Env) -> None:
    # Session fixation: an id the attacker chose (or one they saw before) is never the
    # id a sign-in opens, and each sign-in ends the browser's previous session.
    def sign_in(cookie: str) -> str:
        c = httpx.Client(base_url=env.url, cookies={"proctor_session": cookie})
        csrf = re.search(r'name="csrf" value="([^"]+)"', c.get("/signin").text)
        assert csrf
        r = c.post("/signin", data={"csrf": csrf.group(1), "token": env.gov.token("alice")})
        assert r.status_code == 303
        opened = next(h for h in r.headers.get_list("set-cookie")
                      if h.startswith("proctor_session="))  # fmt: skip
        return opened.split(";")[0].split("=", 1)[1]

    def opens(cookie: str) -> bool:
        c = httpx.Client(base_url=env.url, cookies={"proctor_session": cookie})
        return c.get("/t/acme/").status_code == 200

    planted = "attacker-chosen-" + "a" * 27
    first = sign_in(planted)
    assert first != planted and opens(first) and not opens(planted)
    second = sign_in(first)  # the same browser signs in again
    assert second != first and opens(second) and not opens(first)


def test_an_answer_naming_another_issuer_is_refused_and_spends_the_sign_in(env: Env) -> None:
    # RFC 9207 mix-up: the authorization response says which issuer sent it; one
    # that is not where this sign-in went is refused before any code is exchanged.
    c = httpx.Client(base_url=env.url)
    start = c.get("/signin/oidc", params={"issuer": env.issuer})
    assert start.status_code == 303
    state = parse_qs(urlparse(start.headers["location"]).query)["state"][0]
    r = c.get("/oidc/callback", params={"state": state, "code": "x",
                                        "iss": "https://evil.example"})  # fmt: skip
    assert r.status_code == 400 and "another identity provider" in r.text, r.text[:300]
    # Spent: the same state with the right issuer does not open a session either.
    r = c.get("/oidc/callback", params={"state": state, "code": "x", "iss": env.issuer})
    assert r.status_code == 400 and "not started in this browser" in r.text
    assert "proctor_session" not in c.cookies


def test_failed_token_sign_ins_from_one_address_are_held_back(env: Env) -> None:
    strict = serve_api(env.gov.rt, "127.0.0.1", 0, console=ConsoleConfig(failed_sign_ins=3))
    try:
        c = httpx.Client(base_url=strict.url + "/ui")
        csrf = re.search(r'name="csrf" value="([^"]+)"', c.get("/signin").text)
        assert csrf
        for _ in range(3):
            r = c.post("/signin", data={"csrf": csrf.group(1), "token": "pt_" + "0" * 43})
            assert r.status_code == 401
        # Past the limit even the right token waits: nothing is asked of the API.
        r = c.post("/signin", data={"csrf": csrf.group(1), "token": env.gov.token("alice")})
        assert r.status_code == 429 and "too many failed sign-ins" in r.text
        assert "proctor_session" not in c.cookies
    finally:
        strict.stop()


def test_no_site_can_frame_the_console(env: Env, browser: Any) -> None:
    # Clickjacking: another site's page puts the console in a frame to steer a click
    # on "approve". Chromium obeys frame-ancestors 'none' and renders nothing there;
    # the stylesheet (no such header) in the next frame shows that framing works.
    import http.server
    import threading

    evil = (
        f'<iframe src="{env.url}/t/acme/artifacts/{env.digest}"></iframe>'
        f'<iframe src="{env.url}/static/console.css"></iframe>'
    ).encode()

    class Site(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(evil)))
            self.end_headers()
            self.wfile.write(evil)

        def log_message(self, *args: Any) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Site)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    page = _token_sign_in(env, browser, "alice")  # signed in: the cookie is there
    try:
        page.goto(f"http://127.0.0.1:{site.server_port}/")
        page.wait_for_load_state("load")
        urls = [f.url for f in page.frames if f is not page.main_frame]
        assert f"{env.url}/static/console.css" in urls, urls
        assert not [u for u in urls if "/t/acme/" in u], urls
        assert "chrome-error://chromewebdata/" in urls, urls
    finally:
        page.context.close()
        site.shutdown()
        site.server_close()


def test_oversized_forms_and_other_methods_change_nothing(env: Env) -> None:
    c = _signed_in(env, "alice")
    token = _csrf(c, f"/t/acme/artifacts/{env.digest}")
    target = f"/t/acme/artifacts/{env.digest}/approve"
    before = len(env.approvals(env.digest))
    # Refused by the API's guard before the body is read (the console sits behind it).
    r = c.post(target, content=b"csrf=" + token.encode() + b"&c=" + b"x" * (4 << 20),
               headers={"Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert r.status_code == 413
    r = c.post(target, content=b"{}", headers={"Content-Type": "application/json"})
    assert r.status_code == 415
    for method in ("PUT", "DELETE", "PATCH"):
        assert c.request(method, target, data={"csrf": token}).status_code == 405
    head = c.head(f"/t/acme/artifacts/{env.digest}")
    assert head.status_code == 200 and head.content == b""
    assert len(env.approvals(env.digest)) == before
