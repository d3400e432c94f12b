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

ROLES = ("developer", "approver", "auditor", "admin")
KINDS = ("user", "service")
_NAME_RE = re.compile(r"^[a-z][a-z0-9._-]{0,62}$")
_TOKEN_PREFIX = "pt_"  # noqa: S105 - the prefix that marks a token, not a token


@dataclass(frozen=True)
class Principal:
    tenant: str
    name: str
    kind: str
    roles: tuple[str, ...]
    disabled: bool = False

    @property
    def id(self) -> str:
        return f"{self.tenant}/{self.name}"

    @property
    def actor(self) -> Actor:
        return Actor("user" if self.kind == "user" else "service", self.id)


def _hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token() -> str:
    return _TOKEN_PREFIX + base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")


class Principals:
    def __init__(self, store: Store, ledger: Ledger) -> None:
        self._store = store
        self._ledger = ledger

    def create(
        self, tenant: str, name: str, kind: str, roles: list[str], actor: Actor
    ) -> tuple[Principal, str]:
        """Make a principal; returns it and its token, which is never shown again."""
        if not _NAME_RE.match(name):
            raise UsageError(
                f"invalid principal name {name!r}",
                hint="a lowercase letter, then letters, digits, '.', '_' or '-'",
            )
        if kind not in KINDS:
            raise UsageError(f"principal kind must be one of {', '.join(KINDS)}, not {kind!r}")
        bad = [r for r in roles if r not in ROLES]
        if bad or not roles:
            raise UsageError(
                f"roles must be some of {', '.join(ROLES)}; got {', '.join(roles) or 'none'}"
            )
        principal = Principal(tenant, name, kind, tuple(sorted(set(roles))))
        token = new_token()

        def insert(conn: Conn) -> None:
            if conn.query_one(
                "SELECT 1 FROM principals WHERE tenant = ? AND name = ?", (tenant, name)
            ):
                raise AlreadyExists(f"principal {name!r} exists already in tenant {tenant!r}")
            conn.execute(
                "INSERT INTO principals (tenant, name, kind, roles, token_hash, created_at,"
                " created_by) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (tenant, name, kind, ",".join(principal.roles), _hash(token), utc_now(), actor.id),
            )

        self._ledger.append(
            tenant,
            EventDraft(
                actor,
                Action.PRINCIPAL_CREATE,
                f"principal/{principal.id}",
                reason="created",
                details={"kind": kind, "roles": list(principal.roles)},
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
                "SELECT tenant, name, kind, roles, disabled, token_hash FROM principals"
                " WHERE token_hash = ?",
                (digest,),
            )
        # The lookup is by hash; the comparison below only guards against a store
        # whose index returned a row it should not have.
        if row is None or not hmac.compare_digest(bytes(row[5]), digest):
            raise AuthenticationFailed("the token does not belong to any principal")
        principal = Principal(
            str(row[0]), str(row[1]), str(row[2]), tuple(str(row[3]).split(",")), bool(row[4])
        )
        if principal.disabled:
            raise AuthenticationFailed(f"principal {principal.id} is disabled")
        return principal

    def get(self, tenant: str, name: str) -> Principal:
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT kind, roles, disabled FROM principals WHERE tenant = ? AND name = ?",
                (tenant, name),
            )
        if row is None:
            raise NotFound(f"no principal {name!r} in tenant {tenant!r}")
        return Principal(tenant, name, str(row[0]), tuple(str(row[1]).split(",")), bool(row[2]))

    def list(self, tenant: str) -> list[Principal]:
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT name, kind, roles, disabled FROM principals WHERE tenant = ? ORDER BY name",
                (tenant,),
            )
        return [
            Principal(tenant, str(r[0]), str(r[1]), tuple(str(r[2]).split(",")), bool(r[3]))
            for r in rows
        ]
