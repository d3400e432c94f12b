"""The console's pages: server-rendered HTML over the SDK, mounted at ``/ui``.

Each page is one function of a signed-in person's ``View`` (their session and an
SDK client acting as them). A page that the person's role does not permit shows
the API's refusal; a page of another tenant answers 404 before anything is asked.
Forms carry the session's CSRF token, and a POST without it changes nothing.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import anyio.to_thread
import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Route

from proctor.client import Client
from proctor.console import _pages
from proctor.console._bridge import ASGIApp, client_for
from proctor.console._oidc import SignInFailed, SignInProvider, authorization_url, exchange
from proctor.console._oidc import pkce_pair as _pkce
from proctor.console._pages import Refused
from proctor.console._session import (
    COOKIE,
    LOGIN_COOKIE,
    PendingSignIn,
    Session,
    Sessions,
    Shelf,
    browser_key,
)
from proctor.errors import ProctorError

_HERE = Path(__file__).resolve().parent
_STATIC = {
    "console.css": "text/css; charset=utf-8",
    "htmx.min.js": "text/javascript; charset=utf-8",
    "verify.js": "text/javascript; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
}
_FORM_LIMIT = 64 * 1024
#: What a sign-in's "next" path may hold: URL characters, no space, control or backslash.
_SAFE_PATH = re.compile(r"[A-Za-z0-9/._~%?&=+:@!$'()*,;-]{1,2048}\Z")

#: No inline script or style anywhere: every script and stylesheet is a file of ours.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


@dataclass
class ConsoleConfig:
    """How the console signs people in. ``providers``: OIDC issuers offered on the
    sign-in page. ``public_url``: the console's own origin as people reach it
    (``https://proctor.example.com``), for the OIDC redirect; when unset, the
    origin of the request is used. ``secure``: mark cookies ``Secure`` (default:
    when the request came over TLS)."""

    providers: Sequence[SignInProvider] = ()
    public_url: str | None = None
    secure: bool | None = None
    idle_seconds: float = 900.0
    lifetime_seconds: float = 8 * 3600.0
    tenant_hint: str = ""
    failed_sign_ins: int = 10


@dataclass
class View:
    """One request of a signed-in person."""

    request: Request
    session: Session
    client: Client
    tenant: str
    form: Mapping[str, str] = field(default_factory=dict)
    render: Callable[..., HTMLResponse] = field(default=lambda *a, **k: HTMLResponse(""))

    def page(self, template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        return self.render(template, self.request, self.session, status=status, **ctx)

    def back(self, path: str, kind: str = "", message: str = "") -> RedirectResponse:
        if message:
            self.session.flash.append((kind, message))
        return RedirectResponse(path, status_code=303)

    def param(self, name: str, maxlen: int = 200) -> str | None:
        value = self.request.query_params.get(name)
        if value is None or value.strip() == "":
            return None
        if len(value) > maxlen:
            raise Refused(400, f"the parameter {name} is too long")
        return value.strip()


Handler = Callable[[View], Response]


class Failures:
    """Failed token sign-ins per client address in the last minute. A token is 256
    random bits, so this is not what keeps one from being guessed; it keeps a
    client from turning the sign-in page into a load on the API's authentication
    and its log."""

    WINDOW = 60.0

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def allowed(self, address: str) -> bool:
        now = time.monotonic()
        with self._lock:
            recent = [t for t in self._seen.get(address, ()) if now - t < self.WINDOW]
            if recent:
                self._seen[address] = recent
            else:
                self._seen.pop(address, None)
            return len(recent) < self.limit

    def failed(self, address: str) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._seen) > 10_000:
                # Bounded: the stalest addresses go first.
                for gone in sorted(self._seen, key=lambda a: self._seen[a][-1])[:1_000]:
                    del self._seen[gone]
            self._seen.setdefault(address, []).append(now)


class Console:
    """``shelf``: where sessions are kept (default: this process's memory)."""

    def __init__(
        self, api: ASGIApp, config: ConsoleConfig | None = None, shelf: Shelf | None = None
    ) -> None:
        self.config = config or ConsoleConfig()
        self.sessions = Sessions(self.config.idle_seconds, self.config.lifetime_seconds,
                                 shelf)  # fmt: skip
        self._api = api
        self._providers = {p.issuer: p for p in self.config.providers}
        self._failures = Failures(self.config.failed_sign_ins)
        # Pages wait on the API in worker threads; their own limiter keeps them from
        # taking every thread the API's routes need to answer them.
        self._limiter = anyio.CapacityLimiter(8)
        self._env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(_HERE / "templates")),
            autoescape=jinja2.select_autoescape(["html"]),
            undefined=jinja2.StrictUndefined,
        )
        self._env.filters["q"] = lambda v: quote(str(v), safe="")
        self._env.filters["short"] = _pages.short
        self._env.filters["pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True)
        self._env.globals["urlencode"] = urlencode

    # -- the ASGI app ------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/", self._root),
            Route("/static/{name}", self._static),
            Route("/signin", self._signin, methods=["GET", "POST"]),
            Route("/signin/oidc", self._oidc_start),
            Route("/oidc/callback", self._oidc_callback),
            Route("/signout", self._signout, methods=["POST"]),
        ]
        for path, handler, methods in _pages.ROUTES:
            routes.append(Route("/t/{tenant}" + path, self._page(handler), methods=methods))
        return Starlette(routes=routes)

    # -- rendering ---------------------------------------------------------------

    def render(
        self, template: str, request: Request, session: Session | None, *, status: int = 200,
        **ctx: Any,
    ) -> HTMLResponse:  # fmt: skip
        flash = []
        if session is not None:
            flash, session.flash = session.flash, []
        html = self._env.get_template(template).render(
            me=session, flash=flash, base=self._base(request), **ctx
        )
        resp = HTMLResponse(html, status_code=status)
        self._secure(resp)
        return resp

    def _secure(self, resp: Response) -> Response:
        resp.headers["Content-Security-Policy"] = CSP
        resp.headers["X-Content-Type-Options"] = "nosniff"
        # same-origin, not no-referrer: with no-referrer a form post says "Origin: null".
        resp.headers["Referrer-Policy"] = "same-origin"
        resp.headers["X-Frame-Options"] = "DENY"
        resp.headers.setdefault("Cache-Control", "no-store")
        return resp

    def _base(self, request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    def _cookie_secure(self, request: Request) -> bool:
        if self.config.secure is not None:
            return self.config.secure
        return request.url.scheme == "https"

    def _origin(self, request: Request) -> str:
        if self.config.public_url:
            return self.config.public_url.rstrip("/")
        return f"{request.url.scheme}://{request.url.netloc}"

    def _error(self, request: Request, session: Session | None, status: int, message: str,
               ) -> HTMLResponse:  # fmt: skip
        return self.render("error.html", request, session, status=status, status_code=status,
                           message=message)  # fmt: skip

    # -- sessions ----------------------------------------------------------------

    def _session(self, request: Request) -> Session | None:
        return self.sessions.get(request.cookies.get(COOKIE))

    def _set_session(self, request: Request, resp: Response, session: Session) -> None:
        token = self.sessions.open(session)
        self.sessions.close(request.cookies.get(COOKIE))
        resp.set_cookie(
            COOKIE, token, httponly=True, samesite="strict", secure=self._cookie_secure(request),
            path=self._base(request) + "/",
        )  # fmt: skip

    async def _form(self, request: Request) -> dict[str, str]:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/x-www-form-urlencoded":
            raise Refused(415, "forms are sent as application/x-www-form-urlencoded")
        raw = await request.body()
        if len(raw) > _FORM_LIMIT:
            raise Refused(413, "the form is too large")
        try:
            parsed = parse_qs(raw.decode("utf-8"), keep_blank_values=True, max_num_fields=50)
        except (UnicodeDecodeError, ValueError) as exc:
            raise Refused(400, "the form cannot be read") from exc
        return {k: v[-1] for k, v in parsed.items()}

    def _same_origin(self, request: Request) -> bool:
        origin = request.headers.get("origin")
        # SameSite=Strict keeps the cookie off cross-site posts; the Origin check is
        # the second lock, for browsers that send it (all current ones do on POST).
        return (
            origin is None
            or origin == self._origin(request)
            or origin == (f"{request.url.scheme}://{request.url.netloc}")
        )

    # -- pages of a signed-in person -----------------------------------------------

    def _page(self, handler: Handler) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            session = self._session(request)
            if session is None:
                nxt = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                target = f"{self._base(request)}/signin?{urlencode({'next': nxt})}"
                if request.method != "GET":
                    return self._error(request, None, 401,
                                       "your session has ended: sign in again")  # fmt: skip
                return RedirectResponse(target, status_code=303)
            tenant = request.path_params["tenant"]
            if tenant != session.tenant:
                # Another tenant's page is not there for this person, whatever it holds.
                return self._error(request, session, 404, "no such page")
            form: dict[str, str] = {}
            try:
                if request.method == "POST":
                    form = await self._form(request)
                    if not self._same_origin(request):
                        raise Refused(403, "the form was sent from another site")
                    if not session.csrf_ok(form.get("csrf")):
                        raise Refused(
                            403, "the form's CSRF token is missing or wrong: reload the page"
                        )
            except Refused as exc:
                return self._error(request, session, exc.status, exc.message)
            view = View(request, session, self._client(request, session), tenant, form,
                        self.render)  # fmt: skip
            flash = list(session.flash)
            call = functools.partial(self._run, handler, view)
            resp = await anyio.to_thread.run_sync(call, limiter=self._limiter)
            if session.flash != flash:
                # A message for the next page (or one shown): kept where any node reads it.
                token = request.cookies.get(COOKIE)
                await anyio.to_thread.run_sync(self.sessions.save, token, session)
            return resp

        return endpoint

    def _client(self, request: Request, session: Session) -> Client:
        client = request.client
        address = (client.host, client.port) if client else ("127.0.0.1", 0)
        rid = str(getattr(request.state, "request_id", "") or secrets.token_hex(8))
        return client_for(self._api, session.credential, address=address, request_id=rid)

    def _run(self, handler: Handler, view: View) -> Response:
        try:
            return self._secure(handler(view))
        except Refused as exc:
            return self._error(view.request, view.session, exc.status, exc.message)
        except ProctorError as exc:
            status = int(getattr(exc, "status", 0) or 400)
            if status == 401:
                # The credential no longer works (rotated, disabled, expired): the
                # session ends with it.
                self.sessions.close(view.request.cookies.get(COOKIE))
                return self._error(view.request, None, 401,
                                   f"your sign-in no longer holds: {exc.message}")  # fmt: skip
            return self._error(view.request, view.session, status, exc.message)
        finally:
            view.client.close()

    # -- unauthenticated pages -----------------------------------------------------

    async def _root(self, request: Request) -> Response:
        session = self._session(request)
        if session is None:
            return RedirectResponse(f"{self._base(request)}/signin", status_code=303)
        return RedirectResponse(f"{self._base(request)}/t/{quote(session.tenant)}/",
                                status_code=303)  # fmt: skip

    async def _static(self, request: Request) -> Response:
        name = request.path_params["name"]
        kind = _STATIC.get(name)
        if kind is None:
            return PlainTextResponse("no such file", status_code=404)
        resp = FileResponse(_HERE / "static" / name, media_type=kind)
        resp.headers["Cache-Control"] = "public, max-age=3600"
        resp.headers["X-Content-Type-Options"] = "nosniff"
        return resp

    def _login_cookie(self, request: Request) -> str:
        value = request.cookies.get(LOGIN_COOKIE)
        return value if value and len(value) <= 128 else secrets.token_urlsafe(32)

    def _with_login_cookie(self, request: Request, resp: Response, value: str) -> Response:
        # Lax, not Strict: the identity provider's redirect back is a cross-site
        # navigation, and it must carry this cookie to prove the same browser began.
        resp.set_cookie(
            LOGIN_COOKIE,
            value,
            httponly=True,
            samesite="lax",
            max_age=600,
            secure=self._cookie_secure(request),
            path=self._base(request) + "/",
        )
        return resp

    def _next(self, request: Request, raw: str | None) -> str:
        # Only a path of the console itself, in plain URL characters: never an open
        # redirect ("//host", a backslash, or a tab or newline that browsers drop
        # from "/\t/host" to leave "//host").
        base = self._base(request) + "/"
        if raw and raw.startswith(base) and not raw.startswith("//") and _SAFE_PATH.match(raw):
            return raw
        return ""

    async def _signin(self, request: Request) -> Response:
        browser = self._login_cookie(request)
        nxt = self._next(request, request.query_params.get("next"))
        if request.method == "GET":
            page = self._signin_page(request, browser, nxt)
            return self._with_login_cookie(request, page, browser)
        try:
            form = await self._form(request)
        except Refused as exc:
            return self._error(request, None, exc.status, exc.message)
        expected = request.cookies.get(LOGIN_COOKIE)
        # The sign-in form is protected too (login CSRF): its token is the hash of
        # this browser's sign-in cookie, which another site can neither read nor set.
        if not expected or not secrets.compare_digest(form.get("csrf", ""), browser_key(expected)):
            return self._error(
                request, None, 403, "the form's CSRF token is missing or wrong: reload the page"
            )
        refused, session = await self._check_token(request, form.get("token", ""))
        if session is None:
            status, error = refused
            return self._signin_page(request, browser, nxt, status=status, error=error)
        home = f"{self._base(request)}/t/{quote(session.tenant)}/"
        resp: Response = RedirectResponse(nxt or home, status_code=303)
        self._set_session(request, resp, session)
        resp.delete_cookie(LOGIN_COOKIE, path=self._base(request) + "/")
        return resp

    async def _check_token(self, request: Request, raw: str,
                           ) -> tuple[tuple[int, str], Session | None]:  # fmt: skip
        """The session a pasted token opens, or why it opens none."""
        address = request.client.host if request.client else ""
        if not self._failures.allowed(address):
            return (429, "too many failed sign-ins from this address: wait a minute"), None
        token = raw.strip()
        if not token.startswith("pt_") or len(token) > 512:
            return (400, "paste a principal's token (it begins with pt_)"), None
        try:
            session = await anyio.to_thread.run_sync(
                functools.partial(self._whoami, request, token, "token", time.time() + 1e9),
                limiter=self._limiter,
            )
        except ProctorError as exc:
            self._failures.failed(address)
            return (401, f"that token does not sign in: {exc.message}"), None
        return (200, ""), session

    def _signin_page(self, request: Request, browser: str, nxt: str, *, status: int = 200,
                     error: str = "") -> Response:  # fmt: skip
        return self.render(
            "signin.html", request, None, status=status, csrf=browser_key(browser),
            providers=list(self._providers.values()), error=error, next=nxt,
        )  # fmt: skip

    def _whoami(self, request: Request, credential: str, via: str, expires: float) -> Session:
        probe = Session("", "", (), credential, via, expires)
        client = self._client(request, probe)
        try:
            who = client.whoami()
        finally:
            client.close()
        return Session(str(who["tenant"]), str(who["name"]), tuple(who["roles"]), credential,
                       via, expires)  # fmt: skip

    async def _oidc_start(self, request: Request) -> Response:
        provider = self._providers.get(request.query_params.get("issuer", ""))
        if provider is None:
            return self._error(request, None, 404, "no such identity provider is configured")
        if not self.sessions.room():
            # Each start holds a little memory for ten minutes and is open to anyone:
            # past the cap, starts wait for the oldest to lapse.
            return self._error(request, None, 503,
                               "too many sign-ins under way: try again in a minute")  # fmt: skip
        browser = self._login_cookie(request)
        verifier, challenge = _pkce()
        state, nonce = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        redirect = f"{self._origin(request)}{self._base(request)}/oidc/callback"
        try:
            url = await anyio.to_thread.run_sync(
                authorization_url, provider, redirect, state, nonce, challenge
            )
        except SignInFailed as exc:
            return self._error(request, None, 502, exc.message)
        self.sessions.begin(PendingSignIn(provider.issuer, state, nonce, verifier,
                                          browser_key(browser), time.time()))  # fmt: skip
        return self._with_login_cookie(request, RedirectResponse(url, status_code=303), browser)

    async def _oidc_callback(self, request: Request) -> Response:
        q = request.query_params
        refused = q.get("error")
        if refused:
            return self._error(
                request, None, 401, f"the identity provider refused: {refused[:100]}"
            )
        pending = self.sessions.finish(q.get("state", ""), request.cookies.get(LOGIN_COOKIE))
        if pending is None:
            return self._error(request, None, 400,
                               "this sign-in was not started in this browser, or has expired: "
                               "start again")  # fmt: skip
        said = q.get("iss")
        if said is not None and said.rstrip("/") != pending.issuer.rstrip("/"):
            # RFC 9207: an answer that names another issuer than the one this sign-in
            # went to is a mix-up (a code from one provider sent to another's token
            # endpoint); the sign-in is spent, nothing is exchanged.
            return self._error(request, None, 400,
                               "the answer names another identity provider than the one "
                               "this sign-in went to: start again")  # fmt: skip
        provider = self._providers[pending.issuer]
        redirect = f"{self._origin(request)}{self._base(request)}/oidc/callback"

        def finish() -> Session:
            token, exp = exchange(provider, q.get("code", ""), redirect, pending.verifier,
                                  pending.nonce)  # fmt: skip
            return self._whoami(request, token, provider.issuer, exp)

        try:
            session = await anyio.to_thread.run_sync(finish, limiter=self._limiter)
        except ProctorError as exc:
            return self._error(request, None, 401, f"the sign-in failed: {exc.message}")
        # Not a redirect: this answer ends a navigation that the identity provider's
        # site started, and a SameSite=Strict cookie is not sent on any hop of such a
        # chain. A page of our own that moves on is a same-site navigation.
        done: Response = self.render(
            "continue.html",
            request,
            None,
            target=f"{self._base(request)}/t/{quote(session.tenant)}/",
        )
        self._set_session(request, done, session)
        done.delete_cookie(LOGIN_COOKIE, path=self._base(request) + "/")
        return done

    async def _signout(self, request: Request) -> Response:
        session = self._session(request)
        try:
            form = await self._form(request)
        except Refused as exc:
            return self._error(request, session, exc.status, exc.message)
        if session is None:
            return RedirectResponse(f"{self._base(request)}/signin", status_code=303)
        if not session.csrf_ok(form.get("csrf")) or not self._same_origin(request):
            return self._error(
                request, session, 403, "the form's CSRF token is missing or wrong: reload the page"
            )
        self.sessions.close(request.cookies.get(COOKIE))
        resp = RedirectResponse(f"{self._base(request)}/signin", status_code=303)
        resp.delete_cookie(COOKIE, path=self._base(request) + "/")
        return resp
