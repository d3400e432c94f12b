"""People and service accounts of a tenant, with roles and bearer tokens.

A token is shown once, when made; the store keeps only its SHA-256. The local
operator made at ``proctor init`` is the only identity without a token: it owns
the runtime, but it is not a member of any tenant, so it can never approve.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
from dataclasses import dataclass

from proctor.errors import AlreadyExists, AuthenticationFailed, NotFound, UsageError
from proctor.ledger import Action, Actor, EventDraft, Ledger, utc_now
from proctor.store import Conn, Store

ROLES = ("developer", "approver", "auditor", "admin", "agent")
KINDS = ("user", "service", "agent")
#: An agent holds the agent role and no other: its rights are that role's, and the
#: role policy's forbids on agents hold whatever roles a store row claims.
AGENT_ROLE = "agent"
# An approver's or admin's rights would let an agent approve or re-key: refused with why.
_PERSON_ROLES = ("approver", "admin")
_RESPONSIBLE_MAX = 128
_NAME_RE = re.compile(r"^[a-z][a-z0-9._-]{0,62}$")
_TOKEN_PREFIX = "pt_"  # noqa: S105 - the prefix that marks a token, not a token


@dataclass(frozen=True)
class Principal:
    tenant: str
    name: str
    kind: str
    roles: tuple[str, ...]
    disabled: bool = False
    #: An agent's: the person or team answerable for it (None for people and services).
    responsible: str | None = None

    @property
    def id(self) -> str:
        return f"{self.tenant}/{self.name}"

    @property
    def actor(self) -> Actor:
        return Actor(self.kind if self.kind in ("user", "agent") else "service", self.id)


def _hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token() -> str:
    return _TOKEN_PREFIX + base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")


class Principals:
    def __init__(self, store: Store, ledger: Ledger) -> None:
        self._store = store
        self._ledger = ledger

    def create(
        self, tenant: str, name: str, kind: str, roles: list[str], actor: Actor,
        *, responsible: str | None = None,
    ) -> tuple[Principal, str]:  # fmt: skip
        """Make a principal; returns it and its token, which is never shown again.

        An agent (``kind="agent"``) holds the agent role alone and names who is
        ``responsible`` for it; a person or service never holds the agent role."""
        if not _NAME_RE.match(name):
            raise UsageError(
                f"invalid principal name {name!r}",
                hint="a lowercase letter, then letters, digits, '.', '_' or '-'",
            )
        if kind not in KINDS:
            raise UsageError(f"principal kind must be one of {', '.join(KINDS)}, not {kind!r}")
        if kind == "agent":
            roles = _agent_roles(roles)
            responsible = _check_responsible(responsible)
        elif responsible is not None:
            raise UsageError("only an agent names a responsible person or team (--responsible)")
        elif AGENT_ROLE in roles:
            raise UsageError(
                "the agent role is an agent's alone", hint="create an agent with --kind agent"
            )
        bad = [r for r in roles if r not in ROLES]
        if bad or not roles:
            raise UsageError(
                f"roles must be some of {', '.join(ROLES)}; got {', '.join(roles) or 'none'}"
            )
        principal = Principal(
            tenant, name, kind, tuple(sorted(set(roles))), responsible=responsible
        )
        token = new_token()

        def insert(conn: Conn) -> None:
            if conn.query_one(
                "SELECT 1 FROM principals WHERE tenant = ? AND name = ?", (tenant, name)
            ):
                raise AlreadyExists(f"principal {name!r} exists already in tenant {tenant!r}")
            conn.execute(
                "INSERT INTO principals (tenant, name, kind, roles, token_hash, created_at,"
                " created_by, responsible) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (tenant, name, kind, ",".join(principal.roles), _hash(token), utc_now(), actor.id,
                 responsible),
            )  # fmt: skip

        details: dict[str, object] = {"kind": kind, "roles": list(principal.roles)}
        if responsible is not None:
            details["responsible"] = responsible

        self._ledger.append(
            tenant,
            EventDraft(
                actor,
                Action.PRINCIPAL_CREATE,
                f"principal/{principal.id}",
                reason="created",
                details=details,
            ),
            hook=insert,
        )
        return principal, token

    def rotate(self, tenant: str, name: str, actor: Actor) -> str:
        self.get(tenant, name)
        token = new_token()

        def update(conn: Conn) -> None:
            conn.execute(
                "UPDATE principals SET token_hash = ? WHERE tenant = ? AND name = ?",
                (_hash(token), tenant, name),
            )

        self._ledger.append(
            tenant,
            EventDraft(actor, Action.TOKEN_ISSUE, f"principal/{tenant}/{name}", reason="rotated"),
            hook=update,
        )
        return token

    def set_disabled(self, tenant: str, name: str, disabled: bool, actor: Actor) -> None:
        self.get(tenant, name)

        def update(conn: Conn) -> None:
            conn.execute(
                "UPDATE principals SET disabled = ? WHERE tenant = ? AND name = ?",
                (int(disabled), tenant, name),
            )

        self._ledger.append(
            tenant,
            EventDraft(
                actor,
                Action.PRINCIPAL_DISABLE if disabled else Action.PRINCIPAL_ENABLE,
                f"principal/{tenant}/{name}",
                reason="disabled" if disabled else "enabled",
            ),
            hook=update,
        )

    def authenticate(self, token: str) -> Principal:
        if not token.startswith(_TOKEN_PREFIX):
            raise AuthenticationFailed("the token is not a Proctor token")
        digest = _hash(token)
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT tenant, name, kind, roles, disabled, token_hash, responsible"
                " FROM principals WHERE token_hash = ?",
                (digest,),
            )
        # The lookup is by hash; the comparison below only guards against a store
        # whose index returned a row it should not have.
        if row is None or not hmac.compare_digest(bytes(row[5]), digest):
            raise AuthenticationFailed("the token does not belong to any principal")
        principal = Principal(
            str(row[0]), str(row[1]), str(row[2]), tuple(str(row[3]).split(",")), bool(row[4]),
            None if row[6] is None else str(row[6]),
        )  # fmt: skip
        if principal.disabled:
            raise AuthenticationFailed(f"principal {principal.id} is disabled")
        return principal

    def get(self, tenant: str, name: str) -> Principal:
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT kind, roles, disabled, responsible FROM principals"
                " WHERE tenant = ? AND name = ?",
                (tenant, name),
            )
        if row is None:
            raise NotFound(f"no principal {name!r} in tenant {tenant!r}")
        return Principal(
            tenant, name, str(row[0]), tuple(str(row[1]).split(",")), bool(row[2]),
            None if row[3] is None else str(row[3]),
        )  # fmt: skip

    def list(self, tenant: str) -> list[Principal]:
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT name, kind, roles, disabled, responsible FROM principals"
                " WHERE tenant = ? ORDER BY name",
                (tenant,),
            )
        return [_listed(tenant, r) for r in rows]


def _listed(tenant: str, r: tuple[object, ...]) -> Principal:
    return Principal(
        tenant, str(r[0]), str(r[1]), tuple(str(r[2]).split(",")), bool(r[3]),
        None if r[4] is None else str(r[4]),
    )  # fmt: skip


def _agent_roles(roles: list[str]) -> list[str]:
    """An agent's roles: the agent role, whatever else was asked is refused with why."""
    person = [r for r in roles if r in _PERSON_ROLES]
    if person:
        raise UsageError(
            f"an agent may not hold the {' or '.join(person)} role: a person approves and"
            " administers (GDPR Art. 28(3)(a): the documented instructions come from a person)",
            hint="an agent holds the agent role alone; give no --role",
        )
    other = [r for r in roles if r != AGENT_ROLE]
    if other:
        raise UsageError(
            f"an agent holds the agent role alone, not {', '.join(other)}",
            hint="an agent's rights are the agent role's (docs/agents.md); give no --role",
        )
    return [AGENT_ROLE]


def _check_responsible(responsible: str | None) -> str:
    who = (responsible or "").strip()
    if not who:
        raise UsageError(
            "an agent needs the person or team responsible for it",
            hint="--responsible acme/alice (or a team's name)",
        )
    if len(who) > _RESPONSIBLE_MAX or not who.isprintable():
        raise UsageError(
            f"--responsible must be printable and at most {_RESPONSIBLE_MAX} characters"
        )
    return who
