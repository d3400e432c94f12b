"""The policy texts that decided a pack's events, carried and checked.

Every data-plane event records ``details.policy_version``: ``sha256:`` and the
SHA-256 of the normalized Cedar text of the set its run was decided under (the
tenant's own set, the deployment's permits from its approved capabilities and its
environment's forbid; ``governance.effective_policies``). A pack carries each such
text as ``policies/<hex>.cedar``, the bytes that hash to the version, so an
auditor reads the exact rules with nothing but SHA-256 to tie them to the log.

Where the text comes from: since ``run.start`` carries the text as a ledger
object named by its version (written in the event's transaction), from the
store; for a run recorded before that, it is rebuilt from the tenant's policy
history, the deployments' approved capabilities and the register as it is now,
and kept only if it hashes to the version (so nothing but the right text can be
put in; one that cannot be rebuilt is left out, and ``evidence verify`` names it).

Verification: every cited version's text is present and hashes to it, and a
sample of the recorded Cedar decisions (up to :data:`SAMPLE`, spread evenly over
the period by seq) is decided again with cedarpy from the recorded request: the
decision and the deciding policies must be the recorded ones.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from proctor.errors import PolicyError, ProctorError, VerificationFailed
from proctor.governance import Home, environment_forbid, role_policy
from proctor.ledger import CUT_MARKER, Action, read_objects
from proctor.policy import (
    CedarValue,
    CompiledPolicies,
    Decision,
    Entity,
    EntityRef,
    EntitySet,
    IpAddr,
    Request,
    capability_policies,
    compile_policies,
    decide,
    normalize_text,
    policy_version,
)

POLICY_DIR = "policies/"
#: How many recorded decisions ``evidence verify`` decides again (spread over the period).
SAMPLE = 200
#: The row limit every run had before ``run.start`` recorded it (RunScope's default).
_DEFAULT_ROW_LIMIT = 10_000
#: A path recorded at this length may have been cut (the broker keeps 512 characters).
_PATH_CUT = 512
_VERSION_RE = re.compile(rb'"policy_version":"(sha256:[0-9a-f]{64})"')
#: What :func:`redecide` answers for an event whose request was not recorded whole.
UNDECIDABLE = "its request was not recorded whole"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_CUT = CUT_MARKER.encode("utf-8")
#: The data-plane calls: the ones a pack decides again here, and holds to the approved
#: capabilities (``_verify.py``).
DATA_ACTIONS = frozenset(
    (
        Action.SQL_SELECT,
        Action.SQL_WRITE,
        Action.HTTP_REQUEST,
        Action.FILE_READ,
        Action.FILE_WRITE,
        Action.SECRET_USE,
    )
)


def policy_name(version: str) -> str:
    """Where a pack holds the text of policy version ``sha256:<hex>``."""
    return POLICY_DIR + version.removeprefix("sha256:") + ".cedar"


def cited_version(data: bytes) -> str | None:
    """The policy version an event's bytes cite, if any (no JSON parse: every event
    of a period is looked at)."""
    m = _VERSION_RE.search(data)
    return m.group(1).decode() if m else None


# -- export ---------------------------------------------------------------------------


def policy_texts(rt: Home, tenant: str, versions: Iterable[str]) -> dict[str, str]:
    """The text of each of ``versions`` that can be found: the ledger's object, else a
    rebuilt text that hashes to it. A version found neither way is absent."""
    wanted = {v for v in versions if _DIGEST_RE.match(v)}
    found: dict[str, str] = {}
    for digest, data in read_objects(rt.store, tenant, wanted).items():
        text = data.decode("utf-8", errors="replace")
        if policy_version(text) == digest:
            found[digest] = text
    missing = wanted - set(found)
    if missing:
        for text in _rebuilt(rt, tenant):
            version = policy_version(text)
            if version in missing:
                found[version] = normalize_text(text)
                missing.discard(version)
                if not missing:
                    break
    return found


def _rebuilt(rt: Home, tenant: str) -> Iterator[str]:
    """The sets ``tenant``'s events may have been decided under: the control plane's
    role policy, and the runs' sets as the supervisor composes them
    (``Policies.compiled``): every tenant set ever set (and the empty one) with every
    deployment version's permits and its environment's forbid now."""
    yield role_policy(tenant)  # the control plane's, as this release writes it
    own = [""] + [pv.text for pv in rt.policies.history(tenant)]
    forbids: dict[str, str] = {}
    for dep in rt.deployments.current(tenant):
        for version in rt.deployments.versions(tenant, dep.name):
            try:
                caps = rt.artifacts.get(tenant, version.digest).manifest.capabilities
                permits = capability_policies(tenant, version.name, caps)
                env = version.environment
                if env not in forbids:
                    forbids[env] = environment_forbid(rt.resources, rt.subprocessors, tenant, env)
            except ProctorError:
                continue
            extra = f"{permits}\n{forbids[env]}"
            for text in own:
                yield f"{text}\n{extra}" if text else extra


# -- verification ---------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyCheck:
    versions: int  # distinct versions cited, each text present and hashing to it
    redecided: int  # recorded decisions decided again, all matching
    candidates: int  # Cedar decisions recorded in the period (the sample's population)


def _fail(message: str) -> VerificationFailed:
    return VerificationFailed(message)


def _lines(zf: zipfile.ZipFile, name: str) -> Iterator[bytes]:
    with zf.open(name) as f:
        for line in f:
            yield line.rstrip(b"\n")


class PolicyScan:
    """What verification needs of the period's events, gathered in one pass (the
    caller's: ``add`` each event in order): the versions cited, and the sample of
    recorded decisions to decide again, the first re-decidable event at or after
    every stride-th position, so it is spread over the whole period and the same
    pack gives the same sample."""

    def __init__(self, events: int, sample: int = SAMPLE) -> None:
        self.stride = max(1, -(-events // sample))
        self.sample = sample
        self.target = 0
        self.cited: dict[str, int] = {}  # version -> the first seq citing it
        self.chosen: list[Mapping[str, Any]] = []
        self.candidates = 0
        self._last: object = None
        self.bad: str | None = None

    def add(self, index: int, ev: Mapping[str, Any], data: bytes) -> None:
        """The event at ``index`` (its position in the period), parsed, and its bytes."""
        d = ev.get("details")
        version = d.get("policy_version") if isinstance(d, dict) else None
        if version is None:
            return
        if version != self._last:  # a run's calls cite one version: check it once
            if not isinstance(version, str) or not _DIGEST_RE.match(version):
                # Named in check(): an altered event is named by the tree check first.
                self.bad = (
                    self.bad or f"event seq {ev.get('seq')}: {version!r} is not a policy version"
                )
                return
            self.cited.setdefault(version, int(ev["seq"]))
            self._last = version
        refused_before = str(ev.get("reason", "")).startswith("refused: ")
        if ev.get("action") not in DATA_ACTIONS or refused_before:
            return
        self.candidates += 1
        if (
            index >= self.target
            and len(self.chosen) < self.sample
            # Details cut to the event's bound no longer hold the whole request.
            and _CUT not in data
            and b'_cut":' not in data
        ):
            self.chosen.append(ev)
            self.target = index + self.stride

    def check(
        self,
        zf: zipfile.ZipFile,
        runs: Mapping[str, Mapping[str, Any]],
        environments: Mapping[str, str] | None = None,
        run_environments: Mapping[str, str] | None = None,
    ) -> PolicyCheck:
        """Each cited version's text is in the pack and hashes to it; the sampled
        decisions, decided again with those texts, are the recorded ones.

        ``runs`` are the proven ``run.start`` events by run id (the environment and
        row limit a run's calls were decided with); for a run that started before
        the period, ``run_environments`` (by run id, from the pack's run records) or
        else ``environments`` (by deployment) give its environment (absent: its
        calls are not re-decided). Call after the events are proven.
        """
        if self.bad is not None:
            raise _fail(self.bad)
        names = set(zf.namelist())
        texts: dict[str, str] = {}
        for version, seq in sorted(self.cited.items(), key=lambda kv: kv[1]):
            name = policy_name(version)
            if name not in names:
                raise _fail(
                    f"event seq {seq}: cites policy version {version}, whose text "
                    f"{name} is not in the pack (missing)"
                )
            raw = zf.read(name)
            if "sha256:" + hashlib.sha256(raw).hexdigest() != version:
                raise _fail(
                    f"{name}: does not hash to policy version {version}, which event seq "
                    f"{seq} cites (the text was altered)"
                )
            texts[version] = raw.decode("utf-8")
        compiled: dict[str, CompiledPolicies] = {}
        redecided = 0
        for ev in self.chosen:
            version = str(ev["details"]["policy_version"])
            if version not in compiled:
                try:
                    compiled[version] = compile_policies(texts[version])
                except PolicyError as exc:
                    raise _fail(
                        f"{policy_name(version)}: not a valid policy set: {exc.message}"
                    ) from exc
            sd = (runs.get(str(ev.get("run"))) or {}).get("details") or {}
            environment = (
                sd.get("environment")
                or (run_environments or {}).get(str(ev.get("run")))
                or (environments or {}).get(str(ev.get("deployment")))
            )
            if not isinstance(environment, str):
                continue
            row_limit = int(sd.get("row_limit", _DEFAULT_ROW_LIMIT))
            why = redecide(compiled[version], ev, environment, row_limit)
            if why == UNDECIDABLE:
                continue
            if why is not None:
                raise _fail(
                    f"event seq {ev['seq']} ({ev['action']} {ev['resource']}): decided "
                    f"again with policy {version}, {why}"
                )
            redecided += 1
        return PolicyCheck(len(self.cited), redecided, self.candidates)


def check_policies(
    zf: zipfile.ZipFile,
    runs: Mapping[str, Mapping[str, Any]],
    environments: Mapping[str, str] | None = None,
    sample: int = SAMPLE,
    run_environments: Mapping[str, str] | None = None,
) -> PolicyCheck:
    """:class:`PolicyScan` over the pack's events in a pass of its own, then its
    check (``verify_pack`` gathers the scan in its own pass over the events)."""
    meta = json.loads(zf.read("pack.json"))
    scan = PolicyScan(int(meta["end_seq"]) - int(meta["first_seq"]), sample)
    for index, data in enumerate(_lines(zf, "events/events.jsonl")):
        if b'"policy_version"' in data:
            scan.add(index, json.loads(data), data)
    return scan.check(zf, runs, environments, run_environments)


_Ask = tuple[str, EntityRef, dict[str, CedarValue], list[Entity]]


def _secret_asks(tenant: str, d: Mapping[str, Any]) -> list[_Ask]:
    """The ``secret.use`` questions an ``http.request`` event's injected secrets asked."""
    out: list[_Ask] = []
    for item in d.get("inject") or []:
        ref = EntityRef.secret(tenant, str(item["secret"]))
        out.append((Action.SECRET_USE, ref, {"host": d["host"]}, [Entity.in_tenant(ref, tenant)]))
    return out


def _combined(parts: list[Decision]) -> tuple[str, list[str]]:
    """One call's decision from its questions' (the broker's ``_decide.combine``):
    allowed by every permit when all allow, else denied by the denying parts' policies."""
    if all(p.allowed for p in parts):
        return "allow", sorted({p for d in parts for p in d.policies})
    return "deny", sorted({p for d in parts if not d.allowed for p in d.policies})


def redecide(
    compiled: CompiledPolicies, ev: Mapping[str, Any], environment: str, row_limit: int
) -> str | None:
    """Decide ``ev``'s recorded request again, for a run in ``environment``; why the
    answer differs from the recorded one, or None.

    An event whose request was not recorded whole (a path cut at 512 characters, a
    denied write recorded before its size was) is not decided: :data:`UNDECIDABLE`
    (nor, in :func:`check_policies`, one whose details were cut to the event's bound).
    """
    d: Mapping[str, Any] = ev.get("details") or {}
    tenant, deployment = str(ev["tenant"]), str(ev.get("deployment"))
    workload = str(ev["actor"]["id"])
    base = [
        Entity.workload(
            workload,
            tenant=tenant,
            deployment=deployment,
            environment=environment,
            artifact=ev.get("artifact"),
            run=str(ev.get("run")),
        ),
        Entity.deployment(tenant, deployment),
        Entity(EntityRef.tenant(tenant)),
    ]
    principal = EntityRef.workload(workload)
    action = str(ev["action"])
    questions: list[tuple[list[_Ask], str, list[str]]] = []
    context: dict[str, CedarValue]
    recorded = (str(ev["decision"]), sorted(ev.get("policies") or []))
    try:
        if action in (Action.SQL_SELECT, Action.SQL_WRITE):
            dataset = str(d.get("dataset"))
            for t in d.get("tables") or []:
                said = (str(t["decision"]), sorted(t.get("policies") or []))
                try:
                    table = Entity.table(tenant, dataset, str(t["table"]),
                                         synthetic=bool(d.get("synthetic")))  # fmt: skip
                except PolicyError:
                    # A table no policy can name is denied by no policy (the broker's rule).
                    if said != ("deny", []):
                        return f"table {t['table']!r} cannot be named, but the log records {said}"
                    continue
                context = {"dataset": dataset, "columns": list(t.get("columns") or []),
                           "row_limit": row_limit}  # fmt: skip
                questions.append(([(str(t["action"]), table.uid, context, [table])], *said))
        elif action == Action.HTTP_REQUEST:
            path = d.get("path")
            if isinstance(path, str) and len(path) >= _PATH_CUT:
                return UNDECIDABLE
            context = {"method": d["method"], "port": int(d["port"])}
            for key in ("scheme", "path", "rules"):  # rules: the host's request rules
                if key in d:
                    context[key] = d[key]
            if "address" in d:
                context["address"] = IpAddr(str(d["address"]))
            host = Entity.host(str(d["host"]))
            # Event format 2 (docs/egress.md): the secrets a request carried were
            # asked with it, one decision for the call.
            asks = [(action, host.uid, context, [host]), *_secret_asks(tenant, d)]
            questions.append((asks, *recorded))
        elif action in (Action.FILE_READ, Action.FILE_WRITE):
            ref = EntityRef.bucket(tenant, str(d["bucket"]))
            context = {"key": d["key"]}
            if action == Action.FILE_WRITE:
                if "bytes" not in d:
                    return UNDECIDABLE
                context["bytes"] = int(d["bytes"])
            questions.append(([(action, ref, context, [Entity.in_tenant(ref, tenant)])], *recorded))
        elif action == Action.SECRET_USE:
            ref = EntityRef.secret(tenant, str(d["secret"]))
            context = {"host": d["host"]}
            questions.append(([(action, ref, context, [Entity.in_tenant(ref, tenant)])], *recorded))
    except (KeyError, TypeError, ValueError, PolicyError) as exc:
        return f"its recorded request cannot be read ({exc!r})"
    for asks, decision, policies in questions:
        parts = [
            decide(compiled, Request(principal, act, resource, ctx), EntitySet([*base, *extra]))
            for act, resource, ctx, extra in asks
        ]
        got, by = _combined(parts)
        if (got, by) != (decision, policies):
            was = f"{decision} by {', '.join(policies) or 'no policy'}"
            now = f"{got} by {', '.join(by) or 'no policy'}"
            return f"gives {now}, but the log records {was}"
    return None
