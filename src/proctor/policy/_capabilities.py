"""Cedar permits from an approved capability set.

The approved capabilities of one deployment become the only permits its
workloads have. Each permit carries an ``@id`` naming the capability entry
it came from, so a decision in the ledger points back at the approval line
that allowed it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proctor.errors import PolicyError
from proctor.policy._egress_rules import egress_rules
from proctor.policy._hosts import DEFAULT_PORT, normalize_host, split_host_port
from proctor.policy._model import EntityRef
from proctor.policy._schema import action_literal, cedar_string

#: ``egress_rules`` (request rules per egress entry) makes no permit of its own: the
#: broker enforces the rules and names them in refusals, and Cedar sees them as the
#: ``rules`` record of ``http.request``'s context (``_egress_rules.py``).
# ``ask`` makes no permit: it names calls of the others that wait for a person.
CAPABILITY_KEYS = frozenset({"datasets", "egress", "egress_rules", "secrets", "buckets", "ask"})
_ACCESS = {
    "read": ("read",),
    "write": ("write",),
    "read-write": ("read", "write"),
}
_SQL_ACTIONS = {"read": "sql.select", "write": "sql.write"}
_FILE_ACTIONS = {"read": "file.read", "write": "file.write"}


def capability_policies(tenant: str, deployment: str, capabilities: Mapping[str, Any]) -> str:
    """Cedar policy text permitting exactly ``capabilities`` to ``deployment``'s workloads.

    ``capabilities``::

        {"datasets": {"crm": {"tables": {"customers":
             {"columns": ["id", "country"], "access": "read"}}}},
         "egress": ["api.example.com:443", "*.example.org"],
         "egress_rules": {"api.example.com:443": {"methods": ["GET"],
                                                  "paths": ["/v1/customers/*"]}},
         "secrets": ["crm_token"],
         "buckets": {"reports": "write"}}

    Access is ``read``, ``write`` or ``read-write``, each meaning only what
    it says (a SQL ``UPDATE ... WHERE`` reads the columns it filters on, so
    it needs ``read-write``). An egress entry without a port allows port
    443 only; ``*.domain`` matches any name below ``domain``, never
    ``domain`` itself. Unknown keys are refused rather than dropped, so a
    capability this function does not understand is never silently lost.
    The output is sorted, so the same capabilities give the same text and
    therefore the same policy version.
    """
    unknown = set(capabilities) - CAPABILITY_KEYS
    if unknown:
        raise PolicyError(
            f"unknown capability keys: {', '.join(sorted(unknown))}",
            hint="known: " + ", ".join(sorted(CAPABILITY_KEYS)),
        )
    # Checked here too: rules that could not be enforced are refused at submit.
    egress_rules(capabilities)
    principal = f"principal in {EntityRef.deployment(tenant, deployment)}"
    prefix = f"deploy:{deployment}"
    policies: list[str] = []
    policies += _sql(tenant, principal, prefix, capabilities.get("datasets", {}))
    policies += _egress(principal, prefix, capabilities.get("egress", []))
    policies += _secrets(tenant, principal, prefix, capabilities.get("secrets", []))
    policies += _buckets(tenant, principal, prefix, capabilities.get("buckets", {}))
    return "\n\n".join(policies) + ("\n" if policies else "")


def _permit(policy_id: str, principal: str, actions: list[str], resource: str, when: str) -> str:
    if len(actions) == 1:
        action = f"action == {action_literal(actions[0])}"
    else:
        action = "action in [" + ", ".join(action_literal(a) for a in actions) + "]"
    text = f"@id({cedar_string(policy_id)})\npermit (\n  {principal},\n  {action},\n  {resource}\n)"
    if when:
        text += f"\nwhen {{ {when} }}"
    return text + ";"


def _access(what: str, value: Any) -> tuple[str, ...]:
    if value not in _ACCESS:
        raise PolicyError(f"{what}: access must be one of {', '.join(_ACCESS)}, not {value!r}")
    return _ACCESS[value]


def _mapping(what: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise PolicyError(f"{what} must be a mapping")
    return value


def _string_list(what: str, value: Any) -> list[str]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise PolicyError(f"{what} must be a list of strings")
    return list(value)


def _sql(tenant: str, principal: str, prefix: str, datasets: Any) -> list[str]:
    out = []
    for dataset, raw_spec in sorted(_mapping("datasets", datasets).items()):
        spec = _mapping(f"datasets.{dataset}", raw_spec)
        extra = set(spec) - {"tables"}
        if extra:
            raise PolicyError(f"datasets.{dataset}: unknown keys {', '.join(sorted(extra))}")
        tables = _mapping(f"datasets.{dataset}.tables", spec.get("tables", {}))
        for table, raw_grant in sorted(tables.items()):
            where = f"datasets.{dataset}.tables.{table}"
            grant = _mapping(where, raw_grant)
            extra = set(grant) - {"columns", "access"}
            if extra:
                raise PolicyError(f"{where}: unknown keys {', '.join(sorted(extra))}")
            columns = sorted(set(_string_list(f"{where}.columns", grant.get("columns"))))
            if not columns:
                raise PolicyError(f"{where}: list the columns the code may touch")
            if any(not c or not c.isprintable() for c in columns):
                raise PolicyError(f"{where}: column names must be non-empty and printable")
            access = _access(where, grant.get("access", "read"))
            resource = f"resource == {EntityRef.table(tenant, dataset, table)}"
            column_set = "[" + ", ".join(cedar_string(c) for c in columns) + "]"
            # approved.containsAll(requested): every column the statement
            # touches must be approved; the reverse would pass SELECT * as
            # long as it included the approved ones.
            when = (
                f"context.dataset == {cedar_string(dataset)} && "
                f"{column_set}.containsAll(context.columns)"
            )
            out.append(
                _permit(
                    f"{prefix}:sql:{dataset}.{table}",
                    principal,
                    [_SQL_ACTIONS[a] for a in access],
                    resource,
                    when,
                )
            )
    return out


def _egress(principal: str, prefix: str, entries: Any) -> list[str]:
    out: dict[str, str] = {}
    for entry in _string_list("egress", entries):
        host, port = split_host_port(entry)
        port = DEFAULT_PORT if port is None else port
        if host.startswith("*."):
            # Matching happens in Cedar (`like`) so the permit shows exactly
            # what was approved; it is safe because host names reach Cedar
            # normalized (lower-case, ASCII, no empty labels, no '*'), and
            # `like` is anchored at both ends: "*.example.org" needs a
            # non-empty name, a dot, then exactly "example.org".
            suffix = normalize_host(host[2:])
            if suffix.count(".") < 1 or not any(c.isalpha() for c in suffix):
                raise PolicyError(
                    f"egress entry {entry!r}: a wildcard needs a domain of two labels or more"
                )
            name = f"*.{suffix}"
            resource = "resource"
            when = f"resource.name like {cedar_string(name)} && context.port == {port}"
        elif "*" in host:
            raise PolicyError(
                f"egress entry {entry!r}: '*' is allowed only as a whole first label ('*.domain')"
            )
        else:
            name = normalize_host(host)
            resource = f"resource == {EntityRef('Host', name)}"
            when = f"context.port == {port}"
        policy_id = f"{prefix}:egress:{_display(name)}:{port}"
        out[policy_id] = _permit(policy_id, principal, ["http.request"], resource, when)
    return [out[k] for k in sorted(out)]


def _display(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _secrets(tenant: str, principal: str, prefix: str, secrets: Any) -> list[str]:
    return [
        _permit(
            f"{prefix}:secret:{name}",
            principal,
            ["secret.use"],
            f"resource == {EntityRef.secret(tenant, name)}",
            "",
        )
        for name in sorted(set(_string_list("secrets", secrets)))
    ]


def _buckets(tenant: str, principal: str, prefix: str, buckets: Any) -> list[str]:
    out = []
    for name, value in sorted(_mapping("buckets", buckets).items()):
        access = _access(f"buckets.{name}", value)
        out.append(
            _permit(
                f"{prefix}:file:{name}",
                principal,
                [_FILE_ACTIONS[a] for a in access],
                f"resource == {EntityRef.bucket(tenant, name)}",
                "",
            )
        )
    return out
