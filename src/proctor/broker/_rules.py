"""Request rules: what one request to an egress host may do (pure logic, no I/O).

The approved capabilities may give an egress host rules (``policy.EgressRule``:
methods, path patterns, body bytes per call and per run, body digests). The
broker terminates TLS for every host with rules, reads each request inside the
tunnel (``_inject.py``) or the one plain-HTTP request (``_proxy.py``), and asks
this module:

- :func:`check_request`: is the method allowed, and does the path match a pattern?
  The path is read the way an upstream would: percent-decoded once, and refused
  whole when an upstream could read it as another path (a ``.`` or ``..``
  segment, an encoded ``/`` or ``\\``, ``//``, ``;`` path parameters, a ``%``
  left after decoding, control characters), so a pattern cannot be passed by a
  spelling that the upstream normalizes into a path outside it;
- :class:`Meter`: the body bytes of one request and its response, against the
  bounds per call and the run's totals (kept on ``RunScope.egress_totals``, one
  entry per rule, shared by every connection of the run). A body whose length is
  announced is charged in full before a byte of it moves, so two connections
  cannot both pass the last bytes of a total;
- :class:`BodyDigests`: SHA-256 of each request and response body, when a rule
  says the bodies are recorded as digests.

Every refusal is a :class:`Breach` naming the rule that refused it
(``proctor:egress:rule:<host:port>:<key>``), which the callers record and answer.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

from proctor.broker._egress import EgressDenied, Host, UpstreamFailed, host_matches
from proctor.broker._scope import EgressTotals
from proctor.policy import EgressRule, egress_rules

#: How many requests' body digests one completion record lists (its event has a
#: bound); ``bodies_chain`` commits to every one of them, however many.
MAX_LISTED_BODIES = 32


@dataclass(frozen=True)
class Breach:
    """A request or response a rule refuses: the rule's id and why, for people."""

    rule: str
    message: str
    key: str

    def details(self) -> dict[str, Any]:
        return {"rule": self.rule, "key": self.key}


class RuleRefused(EgressDenied):
    """A request a rule refuses (403), recorded as an ``http.request`` deny naming it."""

    def __init__(self, breach: Breach, details: Mapping[str, Any]) -> None:
        super().__init__(breach.message, policies=(breach.rule,))
        self.details = {**details, **breach.details()}


class ResponseCut(UpstreamFailed):
    """A response a rule withheld or cut (502 if nothing of it was sent), recorded as
    an ``http.request`` deny naming the rule."""

    def __init__(self, breach: Breach, details: Mapping[str, Any]) -> None:
        super().__init__(breach.message, policies=(breach.rule,))
        self.details = {**details, **breach.details()}


def approved_rules(capabilities: Mapping[str, Any]) -> dict[str, EgressRule]:
    """The request rules of approved ``capabilities`` (``RunScope.egress_rules``), and the
    entries whose TLS the broker ends for them (``rule_hosts``: the run's CA bundle
    must vouch for their names)."""
    return egress_rules(capabilities)


def rule_hosts(rules: Mapping[str, EgressRule]) -> list[str]:
    """The host entries of ``rules``: names the run's CA bundle must vouch for."""
    return sorted(rules)


def rules_for(rules: Mapping[str, EgressRule], host: Host, port: int) -> tuple[EgressRule, ...]:
    """Every rule whose entry covers ``host:port``. All of them apply: a host under a
    wildcard entry with rules and an exact entry with rules is held to both."""
    return tuple(r for entry, r in sorted(rules.items()) if host_matches(entry, host, port))


def rules_context(rules: Sequence[EgressRule]) -> dict[str, Any] | None:
    """The ``rules`` record of ``http.request``'s context: the first rule's (by entry);
    None when the host has none. Where two entries' rules apply, Cedar sees the
    exact entry's if there is one (sorted after ``*.``), else the first wildcard's."""
    if not rules:
        return None
    exact = [r for r in rules if not r.entry.startswith("*.")]
    return (exact or list(rules))[0].context()


# -- methods and paths ---------------------------------------------------------


def check_request(rules: Iterable[EgressRule], method: str, target: str) -> Breach | None:
    """The first rule ``method target`` breaks (origin-form target, query included)."""
    for rule in rules:
        if rule.methods is not None and method not in rule.methods:
            return Breach(
                rule.rule_id("methods"),
                f"{method} is not a method the rules of {rule.entry} allow "
                f"({', '.join(rule.methods)})",
                "methods",
            )
        if rule.paths is not None:
            path, why = decoded_path(target)
            if path is None:
                return Breach(
                    rule.rule_id("paths"),
                    f"the path cannot be matched against the rules of {rule.entry}: {why}",
                    "paths",
                )
            if not any(_pattern(p).fullmatch(path) for p in rule.paths):
                return Breach(
                    rule.rule_id("paths"),
                    f"the path is outside the patterns the rules of {rule.entry} allow "
                    f"({', '.join(rule.paths)})",
                    "paths",
                )
    return None


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def decoded_path(target: str) -> tuple[str | None, str]:
    """(the path of ``target`` percent-decoded once, "") or (None, why it is ambiguous)."""
    raw = target.split("?", 1)[0]
    why = _raw_ambiguity(raw)
    if why:
        return None, why
    try:
        path = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        return None, "percent-escapes that are not UTF-8"
    segments = path[1:].split("/")
    if "%" in path:
        why = "a '%' left after decoding (encoded twice)"
    elif _CONTROL.search(path) or "\\" in path or ";" in path:
        why = "a control character, a backslash or a ';' in the decoded path"
    elif any(s in (".", "..") for s in segments):
        why = "a '.' or '..' segment"
    elif any(s == "" for s in segments[:-1]):
        why = "an empty segment ('//')"
    return (None, why) if why else (path, "")


def _raw_ambiguity(raw: str) -> str:
    if not raw.startswith("/"):
        return "not an origin-form path"
    if "#" in raw or "\\" in raw or _CONTROL.search(raw):
        return "a fragment, a backslash or a control character in the path"
    lowered = raw.lower()
    if "%2f" in lowered or "%5c" in lowered:
        return "an encoded '/' or '\\' in the path"
    return ""


@lru_cache(maxsize=1024)
def _pattern(pattern: str) -> re.Pattern[str]:
    # `*`: one or more characters of one segment; `**` (the whole last segment):
    # one or more whole segments. Everything else is literal.
    out = []
    segments = pattern[1:].split("/")
    for i, segment in enumerate(segments):
        if segment == "**" and i == len(segments) - 1:
            out.append(r"[^/]+(?:/[^/]+)*")
        else:
            out.append("[^/]+".join(re.escape(part) for part in segment.split("*")))
    return re.compile("/" + "/".join(out))


# -- bytes ---------------------------------------------------------------------


class Meter:
    """The body bytes of one request and its response against its host's rules.

    ``totals`` is the run's (``RunScope.egress_totals``), keyed by rule entry. A
    method returns the :class:`Breach` that refuses, or None; what it lets
    through is charged to the run's totals at once.
    """

    def __init__(
        self,
        rules: Sequence[EgressRule],
        totals: MutableMapping[str, EgressTotals],
        where: Mapping[str, Any] | None = None,
        bodies: BodyDigests | None = None,
    ) -> None:
        self.rules = tuple(rules)
        #: Where the host's rules ask for the bodies' digests: the exchange's record.
        self.bodies = bodies
        #: What a refusal records of the request (host, port, method, path).
        self.where = dict(where or {})
        self._totals = [totals.setdefault(r.entry, EgressTotals()) for r in self.rules]
        self.up = 0  # request body bytes of this call, announced or sent
        self.down = 0  # response body bytes of this call, passed on
        self._up_reserved = 0
        self._streamed = 0  # request body bytes seen streaming

    @property
    def bounded(self) -> bool:
        return any(
            r.request_bytes is not None
            or r.response_bytes is not None
            or r.run_request_bytes is not None
            or r.run_response_bytes is not None
            for r in self.rules
        )

    def refused(self, breach: Breach) -> RuleRefused:
        """The refusal of the request ``breach`` stops."""
        return RuleRefused(breach, self.where)

    def cut(self, breach: Breach, status: int) -> ResponseCut:
        """The refusal of the response ``breach`` withholds or cuts."""
        return ResponseCut(breach, {**self.where, "status": status, "response_bytes": self.down})

    def digest_request(self, data: bytes) -> None:
        if self.bodies is not None:
            self.bodies.request(data)

    def digest_response(self, data: bytes) -> None:
        if self.bodies is not None:
            self.bodies.response(data)

    def announce_request(self, length: int) -> Breach | None:
        """A request body of ``length`` bytes (``Content-Length``): refused whole before
        a byte of it is sent, or charged whole now."""
        breach = self._check_up(length)
        if breach is None:
            self._charge_up(length)
            self._up_reserved = self.up
        return breach

    def request(self, n: int) -> Breach | None:
        """``n`` more bytes of a request body whose length was not announced (chunked):
        refused before they are sent once the bound would be passed."""
        before, self._streamed = self._streamed, self._streamed + n
        if self._streamed <= self._up_reserved:
            return None  # inside what was announced and charged
        extra = self._streamed - max(before, self._up_reserved)
        breach = self._check_up(extra)
        if breach is None:
            self._charge_up(extra)
        return breach

    def _check_up(self, n: int) -> Breach | None:
        for rule, total in zip(self.rules, self._totals, strict=True):
            if rule.request_bytes is not None and self.up + n > rule.request_bytes:
                return Breach(
                    rule.rule_id("request_bytes"),
                    f"the request body is over the {rule.request_bytes} bytes a call to "
                    f"{rule.entry} may send",
                    "request_bytes",
                )
            if rule.run_request_bytes is not None and total.request + n > rule.run_request_bytes:
                return Breach(
                    rule.rule_id("run_request_bytes"),
                    f"the run has sent {total.request} of the {rule.run_request_bytes} request "
                    f"body bytes its calls to {rule.entry} may send in all; this body is over",
                    "run_request_bytes",
                )
        return None

    def _charge_up(self, n: int) -> None:
        self.up += n
        for total in self._totals:
            total.request += n

    def allowance(self) -> int | None:
        """How many more response body bytes may pass (None: no bound)."""
        room: int | None = None
        for rule, total in zip(self.rules, self._totals, strict=True):
            for bound, used in ((rule.response_bytes, self.down),
                                (rule.run_response_bytes, total.response)):  # fmt: skip
                if bound is not None:
                    left = max(0, bound - used)
                    room = left if room is None else min(room, left)
        return room

    def announce_response(self, length: int) -> Breach | None:
        """A response body of ``length`` bytes (``Content-Length``): over the allowance it
        is withheld before its head is passed on; else it is charged whole now."""
        room = self.allowance()
        if room is not None and length > room:
            return self._down_breach(length, "withheld")
        self._charge_down(length)
        return None

    def response(self, n: int, announced: bool = False) -> tuple[int, Breach | None]:
        """``n`` more response body bytes: how many of them may pass (charged), and the
        breach when the rest must be cut. ``announced``: charged already."""
        if announced:
            return n, None
        room = self.allowance()
        if room is None or n <= room:
            self._charge_down(n)
            return n, None
        self._charge_down(room)
        return room, self._down_breach(1, "cut")

    def _charge_down(self, n: int) -> None:
        self.down += n
        for total in self._totals:
            total.response += n

    def _down_breach(self, extra: int, cut: str) -> Breach:
        """The rule ``extra`` more response bytes would break (``cut``: what is done)."""
        for rule, total in zip(self.rules, self._totals, strict=True):
            if rule.response_bytes is not None and self.down + extra > rule.response_bytes:
                return Breach(
                    rule.rule_id("response_bytes"),
                    f"the response body is over the {rule.response_bytes} bytes a call to "
                    f"{rule.entry} may receive; it was {cut}",
                    "response_bytes",
                )
            if (
                rule.run_response_bytes is not None
                and total.response + extra > rule.run_response_bytes
            ):
                return Breach(
                    rule.rule_id("run_response_bytes"),
                    f"the response body is over what is left of the {rule.run_response_bytes} "
                    f"response body bytes the run's calls to {rule.entry} may receive in all; "
                    f"it was {cut}",
                    "run_response_bytes",
                )
        raise AssertionError("no response bound is passed")


# -- body digests ----------------------------------------------------------------


@dataclass
class BodyDigests:
    """SHA-256 of each request's and response's body, for the completion record: the
    first :data:`MAX_LISTED_BODIES` listed, and a chain committing to all of them."""

    listed: list[dict[str, Any]] = field(default_factory=list)
    count: int = 0
    _chain: Any = field(default_factory=hashlib.sha256, repr=False)
    _request: Any = field(default=None, repr=False)
    _response: Any = field(default=None, repr=False)
    _method: str = ""

    def start(self, method: str) -> None:
        self._request, self._response = hashlib.sha256(), hashlib.sha256()
        self._method = method[:32]

    def request(self, data: bytes) -> None:
        if self._request is not None:
            self._request.update(data)

    def response(self, data: bytes) -> None:
        if self._response is not None:
            self._response.update(data)

    def finish(self, status: int | None) -> None:
        """The request and response of one exchange are complete (or cut): record them
        (once: a second call, or one with no exchange started, records nothing)."""
        if self._request is None:
            return
        item = {
            "method": self._method,
            "status": status,
            "request_sha256": self._request.hexdigest(),
            "response_sha256": self._response.hexdigest(),
        }
        self._request = self._response = None
        self.count += 1
        self._chain.update(f"{item['request_sha256']}{item['response_sha256']}".encode())
        if len(self.listed) < MAX_LISTED_BODIES:
            self.listed.append(item)

    def to_json(self) -> dict[str, Any]:
        return {
            "bodies": list(self.listed),
            "bodies_count": self.count,
            "bodies_chain": "sha256:" + self._chain.hexdigest(),
        }


def wants_digests(rules: Iterable[EgressRule]) -> bool:
    return any(r.body_digests for r in rules)
