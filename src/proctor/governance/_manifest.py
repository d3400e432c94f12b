"""``proctor.toml``: what an artifact is, why it runs, and everything it asks for.

The manifest is the part of an artifact an approver signs off: the
entrypoint, the purpose of processing (GDPR Art. 5(1)(b)), the capabilities
(datasets, tables and columns, egress hosts and their request rules, secrets,
buckets), the resource
limits and the lifecycle. It is parsed strictly: an unknown key, a wrong
type or an empty purpose is refused with a message naming the key, because a
key this parser silently dropped would be a capability nobody reviewed.

Capabilities come out in exactly the shape
:func:`proctor.policy.capability_policies` takes, normalized (hosts
lower-cased with an explicit port, lists sorted and deduplicated), so two
spellings of the same request have the same ``capabilities_hash``.
"""

from __future__ import annotations

import hashlib
import math
import posixpath
import re
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.errors import PolicyError, UsageError
from proctor.ledger import canonical_json
from proctor.policy import (
    DEFAULT_PORT,
    RULE_KEYS,
    EgressRule,
    capability_policies,
    normalize_host,
    split_host_port,
)

MANIFEST_FILE = "proctor.toml"

MiB = 1024 * 1024
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600
MIN_EVERY_SECONDS = 1.0
MAX_PURPOSE = 2000
# 1 PiB: past any machine, and well inside the integers canonical JSON carries
# exactly (2**53), so every accepted size can be digested and stored.
MAX_SIZE = 1 << 50
# Linux's PID_MAX_LIMIT: a cgroup cannot hold more.
MAX_PIDS = 4 * 1024 * 1024
MAX_CALLS_PER_SECOND = 100_000
MAX_CALL_BURST = 1_000_000
#: A run's calls at the broker, in all (``limits.calls``): past it every further call
#: is refused. The rate alone bounds a long run's events per second, not their total.
DEFAULT_CALLS = 10_000
MAX_CALLS = 1_000_000_000
# The longest host:port there is: a 253-byte name (or a bracketed IPv6 address
# with a zone) and a port; anything longer is refused before it is parsed.
MAX_EGRESS_ENTRY = 300

_ARTIFACT_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?$")
# The same rule as registering a dataset, secret or bucket: a name the
# manifest asks for must be a name the tenant could have registered.
_RESOURCE_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?$", re.IGNORECASE)
_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?$")
_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_TIME_UNITS: dict[str | None, float] = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_TIME_UNITS[None] = 1

ACCESS_LEVELS = ("read", "write", "read-write")
MODES = ("job", "service", "schedule")
RESTART_POLICIES = ("always", "on-failure", "never")
# Interpreters whose first non-option argument is a script that must ship in
# the artifact: `python3 main.py` with no main.py would only fail at run time,
# after someone approved it.
_INTERPRETERS = frozenset(
    {"python", "python3", "sh", "bash", "dash", "node", "perl", "ruby", "Rscript"}
)
# Options after which the interpreter runs no script file of the artifact.
_NO_SCRIPT_OPTIONS = frozenset({"-c", "-m", "-e", "--eval"})

_TOP_KEYS = (
    "artifact", "datasets", "egress", "secrets", "buckets", "ask", "limits", "lifecycle",
)  # fmt: skip
#: How long a call marked ``ask`` waits for a person's answer unless ``ask.timeout``
#: says: past it the call is refused as timed out.
DEFAULT_ASK_SECONDS = 300
MAX_ASK_SECONDS = 24 * 3600


@dataclass(frozen=True)
class RunLimits:
    """Resource ceilings the manifest asks for; ``None`` leaves the runtime's default.

    The first five are the sandbox's (:class:`proctor.sandbox.Limits`); the next
    two are the run's call rate at the broker (``proctor.broker.RateLimit``), and
    ``calls`` the most calls the run may make in all (default :data:`DEFAULT_CALLS`).
    """

    memory_bytes: int | None = None
    wall_seconds: float | None = None
    pids: int | None = None
    cpu: float | None = None
    output_bytes: int | None = None
    calls_per_second: float | None = None
    call_burst: int | None = None
    calls: int | None = None

    def to_json(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key in ("memory_bytes", "wall_seconds", "pids", "cpu", "output_bytes",
                    "calls_per_second", "call_burst", "calls"):  # fmt: skip
            value = getattr(self, key)
            if value is not None:
                out[key] = _number(value)
        return out


@dataclass(frozen=True)
class Lifecycle:
    """How a deployment of this artifact runs: once, on a schedule, or kept up."""

    mode: str = "job"
    every_seconds: float | None = None
    restart: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if self.every_seconds is not None:
            out["every_seconds"] = _number(self.every_seconds)
        if self.restart is not None:
            out["restart"] = self.restart
        return out


@dataclass(frozen=True)
class Manifest:
    name: str
    entrypoint: tuple[str, ...]
    purpose: str
    capabilities: dict[str, Any]
    limits: RunLimits = field(default_factory=RunLimits)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)

    def to_json(self) -> dict[str, Any]:
        """The canonical form: what the digest covers and the store keeps."""
        return {
            "name": self.name,
            "entrypoint": list(self.entrypoint),
            "purpose": self.purpose,
            "capabilities": self.capabilities,
            "limits": self.limits.to_json(),
            "lifecycle": self.lifecycle.to_json(),
        }

    @property
    def capabilities_hash(self) -> str:
        return capabilities_hash(self.capabilities)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        """Rebuild a manifest from :meth:`to_json` output (as kept in the store)."""
        try:
            limits = data.get("limits", {})
            lifecycle = data.get("lifecycle", {})
            return cls(
                name=str(data["name"]),
                entrypoint=tuple(str(a) for a in data["entrypoint"]),
                purpose=str(data["purpose"]),
                capabilities=_normalize_capabilities(dict(data["capabilities"])),
                limits=RunLimits(**limits),
                lifecycle=Lifecycle(**lifecycle),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"malformed stored manifest: {exc}") from exc


def capabilities_hash(capabilities: Mapping[str, Any]) -> str:
    """``sha256:`` + SHA-256 of the RFC 8785 form: what an approval binds."""
    return "sha256:" + hashlib.sha256(canonical_json(dict(capabilities))).hexdigest()


def _number(value: float) -> int | float:
    # 60.0 and 60 are the same limit; one spelling keeps the digest stable.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# -- parsing ---------------------------------------------------------------


def load_manifest(directory: Path) -> Manifest:
    """Read and validate ``directory/proctor.toml``.

    Whether the entrypoint's script ships with it is checked against the
    files actually stored (:func:`check_entrypoint`), by ``Artifacts.submit``.
    """
    path = directory / MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise UsageError(
            f"{directory} has no {MANIFEST_FILE}",
            hint="an artifact is a directory with a proctor.toml; see docs/artifacts.md",
        ) from exc
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    return parse_manifest(raw)


def parse_manifest(source: bytes | str) -> Manifest:
    """Parse and validate the text of a ``proctor.toml``."""
    if isinstance(source, bytes):
        try:
            text = source.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"{MANIFEST_FILE} is not UTF-8: {exc}") from exc
    else:
        text = source
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{MANIFEST_FILE} is not valid TOML: {exc}") from exc
    _known(MANIFEST_FILE, data, _TOP_KEYS)
    artifact = _table("artifact", data.get("artifact"), required=True)
    _known("artifact", artifact, ("name", "entrypoint", "purpose"))
    name = _parse_name(artifact.get("name"))
    entrypoint = _parse_entrypoint(artifact.get("entrypoint"))
    purpose = _parse_purpose(artifact.get("purpose"))
    hosts, rules = _parse_egress(data.get("egress"))
    capabilities: dict[str, Any] = {
        "datasets": _parse_datasets(data.get("datasets")),
        "egress": hosts,
        "secrets": _parse_secrets(data.get("secrets")),
        "buckets": _parse_buckets(data.get("buckets")),
    }
    if rules:
        # Only when there are any, so a manifest without rules keeps the digest it had.
        capabilities["egress_rules"] = rules
    ask = _parse_ask(data.get("ask"), capabilities)
    if ask:
        # Part of what an approver approves (the hash): these calls will be asked.
        capabilities["ask"] = ask
    _check_with_policy(capabilities)
    _check_recorded_size(name, entrypoint, purpose, capabilities)
    return Manifest(
        name=name,
        entrypoint=entrypoint,
        purpose=purpose,
        capabilities=capabilities,
        limits=_parse_limits(data.get("limits")),
        lifecycle=_parse_lifecycle(data.get("lifecycle")),
    )


def check_entrypoint(manifest: Manifest, files: Collection[str]) -> None:
    """Refuse an entrypoint naming a script that is not among ``files``.

    The program (``argv[0]``) may be an absolute guest path, a bare name
    found on the sandbox's PATH, or a path relative to ``/code`` (the
    artifact), which must then be one of its files. For a known interpreter
    (``python3 main.py``, ``sh run.sh``), the first argument that is not an
    option is the script and must be one of its files too.
    """
    argv = manifest.entrypoint
    program = argv[0]
    if "/" in program and not program.startswith("/"):
        _must_ship(program, "the entrypoint's program", files)
    if posixpath.basename(program) not in _INTERPRETERS:
        return
    for arg in argv[1:]:
        if arg in _NO_SCRIPT_OPTIONS:
            return
        if arg.startswith("-"):
            continue
        if not arg.startswith("/"):
            _must_ship(arg, f"the entrypoint's script (run by {program})", files)
        return


def _must_ship(path: str, what: str, files: Collection[str]) -> None:
    normal = posixpath.normpath(path)
    if normal.startswith("../") or normal == "..":
        raise UsageError(f"artifact.entrypoint: {what} {path!r} is outside the artifact")
    if normal not in files:
        raise UsageError(
            f"artifact.entrypoint: {what} {path!r} is not a file of the artifact",
            hint="relative paths are resolved against /code, where the artifact is mounted",
        )


def _type_name(value: object) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def _known(where: str, table: Mapping[str, Any], keys: Collection[str]) -> None:
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise UsageError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} "
            + ", ".join(repr(k) for k in unknown),
            hint="known keys: " + ", ".join(keys),
        )


def _table(where: str, value: Any, *, required: bool = False) -> dict[str, Any]:
    if value is None:
        if required:
            raise UsageError(
                f"{MANIFEST_FILE} has no {where} table",
                hint=f"add an {where} table: name, entrypoint and purpose (docs/artifacts.md)",
            )
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{where} must be a table, not {_type_name(value)}")
    return value


def _string(where: str, value: Any, *, required: bool = True) -> str:
    if value is None and required:
        raise UsageError(f"{where} is missing")
    if not isinstance(value, str):
        raise UsageError(f"{where} must be a string, not {_type_name(value)}")
    return value


def _string_list(where: str, value: Any) -> list[str]:
    if not isinstance(value, list):
        raise UsageError(f"{where} must be an array of strings, not {_type_name(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise UsageError(f"{where}[{i}] must be a string, not {_type_name(item)}")
    return value


def _parse_name(value: Any) -> str:
    name = _string("artifact.name", value)
    if not _ARTIFACT_NAME_RE.match(name):
        raise UsageError(
            f"artifact.name {name!r} is not a valid artifact name",
            hint="1 to 64 lowercase letters, digits, '.', '_' or '-', starting and ending"
            " with a letter or digit",
        )
    return name


def _parse_entrypoint(value: Any) -> tuple[str, ...]:
    if value is None:
        raise UsageError(
            "artifact.entrypoint is missing", hint='for example: ["python3", "main.py"]'
        )
    if isinstance(value, str):
        raise UsageError(
            "artifact.entrypoint must be an array of strings (argv), not a string",
            hint=f"write {value.split()!r}: no shell parses it",
        )
    argv = _string_list("artifact.entrypoint", value)
    if not argv:
        raise UsageError("artifact.entrypoint must not be empty")
    for i, arg in enumerate(argv):
        if "\x00" in arg:
            raise UsageError(f"artifact.entrypoint[{i}] contains a NUL character")
    if not argv[0]:
        raise UsageError("artifact.entrypoint[0] (the program) must not be empty")
    return tuple(argv)


def _parse_purpose(value: Any) -> str:
    if value is None:
        raise UsageError(
            "artifact.purpose is missing",
            hint="state the purpose of processing, e.g. 'Monthly churn report for the"
            " retention team'; approvers and auditors read it",
        )
    purpose = _string("artifact.purpose", value).strip()
    if not purpose:
        raise UsageError("artifact.purpose must not be empty: it is the purpose of processing")
    if len(purpose) > MAX_PURPOSE:
        raise UsageError(f"artifact.purpose is longer than {MAX_PURPOSE} characters")
    if not all(c.isprintable() or c in "\n\t" for c in purpose):
        raise UsageError("artifact.purpose contains control characters")
    return purpose


def _resource_name(where: str, kind: str, name: str) -> str:
    if not _RESOURCE_NAME_RE.match(name):
        raise UsageError(
            f"{where}: invalid {kind} name {name!r}",
            hint="a lowercase letter, then up to 62 lowercase letters, digits or _",
        )
    return name


def _access(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise UsageError(f"{where} must be a string, not {_type_name(value)}")
    if value not in ACCESS_LEVELS:
        raise UsageError(
            f"{where}: unknown access level {value!r}",
            hint="one of " + ", ".join(ACCESS_LEVELS),
        )
    return value


def _parse_datasets(value: Any) -> dict[str, Any]:
    datasets = _table("datasets", value)
    out: dict[str, Any] = {}
    for ds_name, raw_ds in datasets.items():
        where = f"datasets.{ds_name}"
        _resource_name(where, "dataset", ds_name)
        spec = _table(where, raw_ds)
        _known(where, spec, ("tables",))
        tables = _table(f"datasets.{ds_name}.tables", spec.get("tables"))
        if not tables:
            raise UsageError(
                f"{where} names no tables",
                hint=f"add datasets.{ds_name}.tables.<table> with columns = [...] and access",
            )
        out_tables: dict[str, Any] = {}
        for table, raw_grant in tables.items():
            twhere = f"datasets.{ds_name}.tables.{table}"
            if not table or "/" in table or not table.isprintable():
                raise UsageError(f"{twhere}: invalid table name {table!r}")
            grant = _table(twhere, raw_grant)
            _known(twhere, grant, ("columns", "access"))
            if "columns" not in grant:
                raise UsageError(
                    f"{twhere}.columns is missing",
                    hint="list the columns the code may touch; there is no 'all columns'",
                )
            columns = _string_list(f"{twhere}.columns", grant["columns"])
            if not columns:
                raise UsageError(f"{twhere}.columns is empty: list the columns the code may touch")
            for column in columns:
                if not column or not column.isprintable():
                    raise UsageError(f"{twhere}.columns: invalid column name {column!r}")
            access = _access(f"{twhere}.access", grant.get("access", "read"))
            out_tables[table] = {"columns": sorted(set(columns)), "access": access}
        out[ds_name] = {"tables": out_tables}
    return out


def _parse_egress(value: Any) -> tuple[list[str], dict[str, Any]]:
    """``egress.hosts`` normalized, and ``egress.rules`` keyed by the normalized entry."""
    egress = _table("egress", value)
    _known("egress", egress, ("hosts", "rules"))
    hosts: list[str] = []
    if "hosts" in egress:
        entries = _string_list("egress.hosts", egress["hosts"])
        hosts = sorted({_egress_entry(e) for e in entries})
    rules: dict[str, Any] = {}
    for key, raw in _table("egress.rules", egress.get("rules")).items():
        where = f"egress.rules.{_toml_key(key)}"
        entry = _egress_entry(key, where)
        if entry not in hosts:
            raise UsageError(
                f"{where}: {entry} is not one of egress.hosts",
                hint="rules apply to a host the code may call: add it to egress.hosts",
            )
        if entry in rules:
            raise UsageError(f"{where}: {entry} has rules already (two spellings of one host)")
        rules[entry] = _parse_rules(where, entry, _table(where, raw))
    return hosts, rules


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else '"' + key.replace('"', '\\"') + '"'


def _parse_rules(where: str, entry: str, table: dict[str, Any]) -> dict[str, Any]:
    """One host's request rules, in the form the capabilities carry (sizes in bytes)."""
    _known(where, table, RULE_KEYS)
    doc: dict[str, Any] = {}
    for key, value in table.items():
        if key in ("methods", "paths"):
            doc[key] = _string_list(f"{where}.{key}", value)
        elif key == "body_digests":
            if not isinstance(value, bool):
                raise UsageError(f"{where}.body_digests must be true or false, not {value!r}")
            doc[key] = value
        else:
            doc[key] = _parse_size(f"{where}.{key}", value)
    try:
        return EgressRule.from_json(entry, doc).to_json()
    except PolicyError as exc:
        message = exc.message.replace(f"egress rules of {entry}", where, 1)
        raise UsageError(message, hint=exc.hint) from exc


def _egress_entry(entry: str, field: str = "egress.hosts") -> str:
    """``host:port`` with the host normalized and the port explicit."""
    if len(entry) > MAX_EGRESS_ENTRY:
        raise UsageError(f"{field}: {entry[:40]!r}... is longer than a host and port can be")
    where = f"{field}: {entry!r}"
    if "://" in entry or "/" in entry:
        raise UsageError(
            f"{where} is not a host", hint="write host or host:port, no scheme or path"
        )
    try:
        host, port = split_host_port(entry)
        wildcard = host.startswith("*.")
        if "*" in (host[2:] if wildcard else host):
            raise UsageError(f"{where}: '*' is allowed only as a whole first label ('*.domain')")
        name = normalize_host(host[2:] if wildcard else host)
    except PolicyError as exc:
        raise UsageError(f"{where}: {exc.message}", hint=exc.hint) from exc
    if ":" in name:
        name = f"[{name}]"
    if wildcard:
        name = f"*.{name}"
    return f"{name}:{DEFAULT_PORT if port is None else port}"


def _parse_secrets(value: Any) -> list[str]:
    secrets = _table("secrets", value)
    _known("secrets", secrets, ("names",))
    if "names" not in secrets:
        return []
    names = _string_list("secrets.names", secrets["names"])
    return sorted({_resource_name("secrets.names", "secret", n) for n in names})


def _parse_buckets(value: Any) -> dict[str, str]:
    buckets = _table("buckets", value)
    out: dict[str, str] = {}
    for name, access in buckets.items():
        _resource_name("buckets", "bucket", name)
        out[name] = _access(f"buckets.{name}", access)
    return out


def _parse_ask(value: Any, caps: Mapping[str, Any]) -> dict[str, Any]:
    """``[ask]``: the capabilities whose every use waits for a person's answer at run
    time (hosts, bucket writes, table writes), each one the manifest asks for."""
    ask = _table("ask", value)
    _known("ask", ask, ("egress", "buckets", "tables", "timeout"))
    out: dict[str, Any] = {}
    if "egress" in ask:
        entries = sorted({_egress_entry(e, "ask.egress") for e in
                          _string_list("ask.egress", ask["egress"])})  # fmt: skip
        for entry in entries:
            if entry not in caps["egress"]:
                raise UsageError(
                    f"ask.egress: {entry} is not one of egress.hosts",
                    hint="a call is asked only of a host the code may call",
                )
        if entries:
            out["egress"] = entries
    if "buckets" in ask:
        names = sorted(set(_string_list("ask.buckets", ask["buckets"])))
        for name in names:
            _resource_name("ask.buckets", "bucket", name)
            if caps["buckets"].get(name) not in ("write", "read-write"):
                raise UsageError(
                    f"ask.buckets: {name} is not a bucket the manifest writes",
                    hint="writes are asked: give the bucket write or read-write access",
                )
        if names:
            out["buckets"] = names
    if "tables" in ask:
        tables = sorted(set(_string_list("ask.tables", ask["tables"])))
        for dotted in tables:
            ds_name, _, table = dotted.partition(".")
            grant = caps["datasets"].get(ds_name, {}).get("tables", {}).get(table)
            if grant is None or grant["access"] not in ("write", "read-write"):
                raise UsageError(
                    f"ask.tables: {dotted!r} is not a table the manifest writes",
                    hint="name it dataset.table, one with write or read-write access",
                )
        if tables:
            out["tables"] = tables
    if not out:
        if ask:
            raise UsageError("ask names no egress host, bucket or table to ask about")
        return {}
    seconds: int | float = DEFAULT_ASK_SECONDS
    if "timeout" in ask:
        seconds = _number(_parse_duration("ask.timeout", ask["timeout"]))
        if seconds > MAX_ASK_SECONDS:
            raise UsageError("ask.timeout is longer than 24 hours")
    out["timeout_seconds"] = seconds
    return out


def _check_with_policy(capabilities: dict[str, Any]) -> None:
    # The manifest is approved to become exactly these permits; building them
    # now means a capability that could not be deployed is refused at submit.
    try:
        capability_policies("t", "d", capabilities)
    except PolicyError as exc:
        raise UsageError(f"{MANIFEST_FILE} capabilities: {exc.message}", hint=exc.hint) from exc


def _parse_size(where: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value.strip())):
        number = float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()]
        # float() reads hundreds of digits as inf, which int() refuses.
        size = int(number) if math.isfinite(number) and number <= MAX_SIZE else MAX_SIZE + 1
    else:
        raise UsageError(f'{where}: {value!r} is not a size (examples: "256M", "1G", 65536)')
    if size < 0:
        raise UsageError(f"{where} must not be negative")
    if size > MAX_SIZE:
        raise UsageError(f"{where} is larger than 1P")
    return size


def _parse_duration(where: str, value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.match(value.strip())):
        seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    else:
        raise UsageError(f'{where}: {value!r} is not a duration (examples: "30s", "5m", "1h", 90)')
    if not math.isfinite(seconds) or seconds <= 0:
        raise UsageError(f"{where} must be positive")
    return seconds


def _parse_limits(value: Any) -> RunLimits:
    limits = _table("limits", value)
    keys = ("memory", "timeout", "pids", "cpu", "output", "calls_per_second", "call_burst",
            "calls")  # fmt: skip
    _known("limits", limits, keys)
    memory = timeout = pids = cpu = output = burst = calls = None
    rate: float | None = None
    if "memory" in limits:
        memory = _parse_size("limits.memory", limits["memory"])
        if memory < 8 * MiB:
            raise UsageError("limits.memory is below the 8M an interpreter needs")
    if "timeout" in limits:
        timeout = _parse_duration("limits.timeout", limits["timeout"])
        if timeout > MAX_TIMEOUT_SECONDS:
            raise UsageError("limits.timeout is longer than 7 days")
    if "pids" in limits:
        raw = limits["pids"]
        if not isinstance(raw, int) or isinstance(raw, bool) or not 1 <= raw <= MAX_PIDS:
            raise UsageError(
                f"limits.pids must be a positive integer up to {MAX_PIDS}, not {raw!r}"
            )
        pids = raw
    if "cpu" in limits:
        raw = limits["cpu"]
        try:
            cpu = float(raw) if not isinstance(raw, bool) else math.nan
        except (TypeError, ValueError):
            cpu = math.nan
        if not 0.01 <= cpu <= 1024:
            raise UsageError(
                f"limits.cpu must be a number of CPUs between 0.01 and 1024, not {raw!r}"
            )
    if "output" in limits:
        output = _parse_size("limits.output", limits["output"])
    if "calls_per_second" in limits:
        raw = limits["calls_per_second"]
        rate = float(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) else 0.0
        if not 0 < rate <= MAX_CALLS_PER_SECOND:
            raise UsageError(
                f"limits.calls_per_second must be a number of calls between 0 and "
                f"{MAX_CALLS_PER_SECOND}, not {raw!r}"
            )
    if "call_burst" in limits:
        raw = limits["call_burst"]
        if not isinstance(raw, int) or isinstance(raw, bool) or not 1 <= raw <= MAX_CALL_BURST:
            raise UsageError(
                f"limits.call_burst must be a positive integer up to {MAX_CALL_BURST}, not {raw!r}"
            )
        burst = raw
    if "calls" in limits:
        raw = limits["calls"]
        if not isinstance(raw, int) or isinstance(raw, bool) or not 1 <= raw <= MAX_CALLS:
            raise UsageError(
                f"limits.calls must be a positive integer up to {MAX_CALLS}, not {raw!r}",
                hint=f"the most calls one run may make at the broker (default {DEFAULT_CALLS})",
            )
        calls = raw
    return RunLimits(memory, timeout, pids, cpu, output, rate, burst, calls)


def _parse_lifecycle(value: Any) -> Lifecycle:
    lifecycle = _table("lifecycle", value)
    _known("lifecycle", lifecycle, ("mode", "every", "restart"))
    mode = _string("lifecycle.mode", lifecycle.get("mode", "job"))
    if mode not in MODES:
        raise UsageError(
            f"lifecycle.mode: unknown mode {mode!r}", hint="one of " + ", ".join(MODES)
        )
    every = None
    if mode == "schedule":
        if "every" not in lifecycle:
            raise UsageError(
                "lifecycle.every is missing: a schedule needs an interval", hint='e.g. "1h"'
            )
        every = _parse_duration("lifecycle.every", lifecycle["every"])
        if every < MIN_EVERY_SECONDS:
            raise UsageError("lifecycle.every must be at least 1s")
    elif "every" in lifecycle:
        raise UsageError(f'lifecycle.every applies only to mode = "schedule", not {mode!r}')
    restart = None
    if mode == "service":
        restart = _string("lifecycle.restart", lifecycle.get("restart", "on-failure"))
        if restart not in RESTART_POLICIES:
            raise UsageError(
                f"lifecycle.restart: unknown restart policy {restart!r}",
                hint="one of " + ", ".join(RESTART_POLICIES),
            )
    elif "restart" in lifecycle:
        raise UsageError(f'lifecycle.restart applies only to mode = "service", not {mode!r}')
    return Lifecycle(mode, every, restart)


def _normalize_capabilities(capabilities: dict[str, Any]) -> dict[str, Any]:
    out = {
        "datasets": capabilities.get("datasets", {}),
        "egress": list(capabilities.get("egress", [])),
        "secrets": list(capabilities.get("secrets", [])),
        "buckets": capabilities.get("buckets", {}),
    }
    if capabilities.get("egress_rules"):
        out["egress_rules"] = capabilities["egress_rules"]
    if capabilities.get("ask"):
        out["ask"] = capabilities["ask"]
    return out


def egress_entry(entry: str, field: str) -> str:
    """Normalize an egress entry (``host[:port]``, ``*.domain``) the way manifests do."""
    return _egress_entry(entry, field)


#: The most bytes the manifest's recorded part (name, entrypoint, purpose and
#: capabilities, which artifact.submit, approval and deployment events carry) may
#: take as canonical JSON: those events stay under the ledger's MAX_EVENT_BYTES.
MAX_RECORDED_BYTES = 10 * 1024


def _check_recorded_size(
    name: str, entrypoint: tuple[str, ...], purpose: str, capabilities: dict[str, Any]
) -> None:
    doc = {"name": name, "entrypoint": list(entrypoint), "purpose": purpose}
    size = len(canonical_json({**doc, "capabilities": capabilities}))
    if size > MAX_RECORDED_BYTES:
        raise UsageError(
            f"{MANIFEST_FILE}: its name, entrypoint, purpose and capabilities take {size}"
            f" bytes as the audit log records them; at most {MAX_RECORDED_BYTES} are allowed",
            hint="ask for what one job needs (split a larger job into several artifacts)",
        )
