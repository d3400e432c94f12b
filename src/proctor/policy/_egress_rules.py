"""Request rules for one egress host: what a request to it may do, not only where it goes.

A manifest may attach rules to an entry of ``egress.hosts`` (docs/egress.md,
"Request rules"): the methods allowed, the path patterns allowed, the most
request and response body bytes per call and in total per run, and whether the
bodies are recorded as digests. They are approved capabilities (the manifest's
``egress_rules``, part of ``capabilities_hash``), reach Cedar as the
``rules`` record of ``http.request``'s context, and are enforced by the broker,
which terminates TLS for every host with rules so that it reads each request.

This module holds their one canonical form (:class:`EgressRule`) and its checks;
the broker's ``_rules.py`` matches requests against it and counts bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proctor.errors import PolicyError
from proctor.policy._model import CedarValue

#: The rule ids a refusal names: ``proctor:egress:rule:<host:port>:<key>``.
RULE_PREFIX = "proctor:egress:rule"
#: The keys of one host's rules, in the order docs and messages list them.
RULE_KEYS = (
    "methods",
    "paths",
    "request_bytes",
    "response_bytes",
    "run_request_bytes",
    "run_response_bytes",
    "body_digests",
)
BYTE_KEYS = ("request_bytes", "response_bytes", "run_request_bytes", "run_response_bytes")
#: At most this many path patterns per host, each at most this long: the rules
#: go into every ``http.request`` event of the host, which has a bound.
MAX_PATTERNS = 16
MAX_PATTERN = 200
#: 1 PiB, as the manifest's sizes; inside Cedar's Long and canonical JSON's integers.
MAX_BYTES = 1 << 50

_METHOD_RE = re.compile(r"^[A-Z][A-Z0-9_-]{0,31}$")
# What a pattern may hold: printable ASCII, no space, no query or fragment, no
# percent-escape (patterns are matched against the decoded path), no backslash.
_PATTERN_CHARS = re.compile(r"^/[!$&'()*+,\-./0-9:;=@A-Z_a-z~]*$")


@dataclass(frozen=True)
class EgressRule:
    """The rules of one ``egress.hosts`` entry (``entry``: ``host:port`` as normalized).

    ``None`` for a key means the key sets no rule (any method, any path, no bound).
    """

    entry: str
    methods: tuple[str, ...] | None = None
    paths: tuple[str, ...] | None = None
    request_bytes: int | None = None
    response_bytes: int | None = None
    run_request_bytes: int | None = None
    run_response_bytes: int | None = None
    body_digests: bool = False

    def rule_id(self, key: str) -> str:
        """The id a refusal by ``key`` names (``proctor:egress:rule:api.x:443:methods``)."""
        return f"{RULE_PREFIX}:{self.entry}:{key}"

    def to_json(self) -> dict[str, Any]:
        """The canonical form the capabilities carry: keys that set a rule, lists sorted."""
        out: dict[str, Any] = {}
        if self.methods is not None:
            out["methods"] = list(self.methods)
        if self.paths is not None:
            out["paths"] = list(self.paths)
        for key in BYTE_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.body_digests:
            out["body_digests"] = True
        return out

    def context(self) -> dict[str, CedarValue]:
        """The ``rules`` record of ``http.request``'s context (schema: ``EgressRules``)."""
        out: dict[str, CedarValue] = {"body_digests": self.body_digests}
        if self.methods is not None:
            out["methods"] = list(self.methods)
        if self.paths is not None:
            out["paths"] = list(self.paths)
        for key in BYTE_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @classmethod
    def from_json(cls, entry: str, doc: Any) -> EgressRule:
        """Check and normalize one host's rules; a :class:`PolicyError` of one line names
        the host and the key that is wrong."""
        where = f"egress rules of {entry}"
        if not isinstance(doc, Mapping):
            raise PolicyError(f"{where} must be a table of rules")
        unknown = sorted(set(doc) - set(RULE_KEYS))
        if unknown:
            raise PolicyError(
                f"{where}: unknown key{'s' if len(unknown) > 1 else ''} "
                + ", ".join(repr(k) for k in unknown),
                hint="known keys: " + ", ".join(RULE_KEYS),
            )
        methods = paths = None
        if "methods" in doc:
            methods = _methods(where, doc["methods"])
        if "paths" in doc:
            paths = _patterns(where, doc["paths"])
        sizes: dict[str, int | None] = {}
        for key in BYTE_KEYS:
            sizes[key] = _bytes(f"{where}: {key}", doc[key]) if key in doc else None
        digests = doc.get("body_digests", False)
        if not isinstance(digests, bool):
            raise PolicyError(f"{where}: body_digests must be true or false, not {digests!r}")
        rule = cls(
            entry, methods, paths, sizes["request_bytes"], sizes["response_bytes"],
            sizes["run_request_bytes"], sizes["run_response_bytes"], digests,
        )  # fmt: skip
        if not rule.to_json():
            raise PolicyError(
                f"{where} sets no rule",
                hint="set methods, paths, a byte bound or body_digests = true; or drop the table",
            )
        for per_call, per_run in (("request_bytes", "run_request_bytes"),
                                  ("response_bytes", "run_response_bytes")):  # fmt: skip
            a, b = getattr(rule, per_call), getattr(rule, per_run)
            if a is not None and b is not None and a > b:
                raise PolicyError(f"{where}: {per_call} ({a}) is larger than {per_run} ({b})")
        return rule


def egress_rules(capabilities: Mapping[str, Any]) -> dict[str, EgressRule]:
    """The rules of ``capabilities["egress_rules"]``, each checked, keyed by entry; an
    entry must be one of ``capabilities["egress"]`` exactly."""
    raw = capabilities.get("egress_rules") or {}
    if not isinstance(raw, Mapping):
        raise PolicyError("egress_rules must be a mapping of egress entries to rules")
    hosts = capabilities.get("egress") or []
    out: dict[str, EgressRule] = {}
    for entry, doc in sorted(raw.items()):
        if entry not in hosts:
            raise PolicyError(
                f"egress rules name {entry!r}, which is not an egress host of the manifest",
                hint="add it to egress.hosts, or name an entry of egress.hosts as it is written",
            )
        out[entry] = EgressRule.from_json(entry, doc)
    return out


def _methods(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise PolicyError(f"{where}: methods must be an array of method names")
    if not value:
        raise PolicyError(f"{where}: methods is empty: list the methods the code may send")
    out = set()
    for method in value:
        if not _METHOD_RE.match(method):
            raise PolicyError(
                f"{where}: {method!r} is not a method name", hint="upper case, e.g. GET, POST"
            )
        if method == "CONNECT":
            raise PolicyError(f"{where}: CONNECT is not a request a rule can allow")
        out.add(method)
    return tuple(sorted(out))


def _patterns(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise PolicyError(f"{where}: paths must be an array of path patterns")
    if not value:
        raise PolicyError(f"{where}: paths is empty: list the paths the code may ask for")
    patterns = sorted(set(value))
    if len(patterns) > MAX_PATTERNS:
        raise PolicyError(f"{where}: more than {MAX_PATTERNS} path patterns")
    for pattern in patterns:
        check_pattern(where, pattern)
    return tuple(patterns)


def check_pattern(where: str, pattern: str) -> None:
    """A path pattern: ``/`` then segments; ``*`` matches one or more characters of one
    segment, ``**`` (a whole segment, the last) one or more whole segments."""
    shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
    if len(pattern) > MAX_PATTERN:
        raise PolicyError(f"{where}: path pattern {shown!r} is longer than {MAX_PATTERN}")
    if not _PATTERN_CHARS.match(pattern):
        raise PolicyError(
            f"{where}: path pattern {shown!r} must start with '/' and hold no space, '?', "
            "'#', '%' or '\\'",
            hint="patterns match the path alone, percent-decoded; the query is not matched",
        )
    segments = pattern[1:].split("/")
    for i, segment in enumerate(segments):
        if segment in (".", ".."):
            raise PolicyError(f"{where}: path pattern {shown!r} has a '.' or '..' segment")
        if segment == "" and i != len(segments) - 1:
            raise PolicyError(f"{where}: path pattern {shown!r} has an empty segment ('//')")
        if "**" in segment and (segment != "**" or i != len(segments) - 1):
            raise PolicyError(
                f"{where}: path pattern {shown!r}: '**' may only be the whole last segment"
            )


def _bytes(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(f"{where} must be a number of bytes, not {value!r}")
    if not 0 <= value <= MAX_BYTES:
        raise PolicyError(f"{where} must be between 0 and {MAX_BYTES} bytes, not {value}")
    return value
