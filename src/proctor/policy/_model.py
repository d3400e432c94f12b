"""Typed requests and entities, so that callers never write Cedar JSON by hand."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TypeAlias

import cedarpy

from proctor.errors import PolicyError
from proctor.policy._hosts import normalize_host
from proctor.policy._schema import (
    NAMESPACE,
    cedar_string,
    qualify_action,
    schema_handle,
    short_type,
)

_LONG_MIN = -(2**63)
_LONG_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class IpAddr:
    """A Cedar ``ipaddr`` value: one address or a CIDR range."""

    value: str


CedarValue: TypeAlias = (
    "str | int | bool | IpAddr | EntityRef | Sequence[CedarValue] "
    "| AbstractSet[CedarValue] | Mapping[str, CedarValue]"
)


def _check_part(kind: str, part: str) -> str:
    # Tenant-scoped ids are "<tenant>/<name>[/<name>]"; a slash inside a part
    # would let "a/b" + "c" collide with "a" + "b/c".
    if not part or "/" in part or len(part) > 255 or not part.isprintable():
        raise PolicyError(f"invalid {kind} name {part!r}: non-empty, printable, no '/'")
    return part


@dataclass(frozen=True, slots=True)
class EntityRef:
    """The uid of one Cedar entity: a Proctor entity type and an id.

    ``type`` may be given short (``"Table"``) or qualified
    (``"Proctor::Table"``); it is stored short. The class methods build the
    ids Proctor uses everywhere, so that the broker, the store and generated
    policies agree on them.
    """

    type: str
    id: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", short_type(self.type))
        if not isinstance(self.id, str):
            raise PolicyError(f"entity id must be a string, not {type(self.id).__name__}")

    def to_json(self) -> dict[str, str]:
        return {"type": f"{NAMESPACE}::{self.type}", "id": self.id}

    def __str__(self) -> str:
        return f"{NAMESPACE}::{self.type}::{cedar_string(self.id)}"

    @classmethod
    def tenant(cls, tenant: str) -> EntityRef:
        return cls("Tenant", _check_part("tenant", tenant))

    @classmethod
    def _scoped(cls, type_name: str, tenant: str, *parts: tuple[str, str]) -> EntityRef:
        names = [_check_part("tenant", tenant)] + [_check_part(k, p) for k, p in parts]
        return cls(type_name, "/".join(names))

    @classmethod
    def role(cls, tenant: str, role: str) -> EntityRef:
        return cls._scoped("Role", tenant, ("role", role))

    @classmethod
    def user(cls, tenant: str, name: str) -> EntityRef:
        return cls._scoped("User", tenant, ("user", name))

    @classmethod
    def service_account(cls, tenant: str, name: str) -> EntityRef:
        return cls._scoped("ServiceAccount", tenant, ("service account", name))

    @classmethod
    def agent(cls, tenant: str, name: str) -> EntityRef:
        return cls._scoped("Agent", tenant, ("agent", name))

    @classmethod
    def artifact(cls, tenant: str, digest: str) -> EntityRef:
        return cls._scoped("Artifact", tenant, ("artifact", digest))

    @classmethod
    def deployment(cls, tenant: str, name: str) -> EntityRef:
        return cls._scoped("Deployment", tenant, ("deployment", name))

    @classmethod
    def workload(cls, workload_id: str) -> EntityRef:
        """A run's workload identity, its SPIFFE id as given."""
        return cls("Workload", workload_id)

    @classmethod
    def dataset(cls, tenant: str, dataset: str) -> EntityRef:
        return cls._scoped("Dataset", tenant, ("dataset", dataset))

    @classmethod
    def table(cls, tenant: str, dataset: str, table: str) -> EntityRef:
        return cls._scoped("Table", tenant, ("dataset", dataset), ("table", table))

    @classmethod
    def secret(cls, tenant: str, name: str) -> EntityRef:
        return cls._scoped("Secret", tenant, ("secret", name))

    @classmethod
    def bucket(cls, tenant: str, name: str) -> EntityRef:
        return cls._scoped("Bucket", tenant, ("bucket", name))

    @classmethod
    def host(cls, name: str) -> EntityRef:
        """A host by its normalized name (see :func:`normalize_host`)."""
        return cls("Host", normalize_host(name))


def to_cedar_json(value: object) -> object:
    """A Python value as Cedar's JSON value form (entities, contexts)."""
    # bool before int: bool is a subclass of int, and Cedar keeps them apart.
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        if not _LONG_MIN <= value <= _LONG_MAX:
            raise PolicyError(f"integer {value} does not fit a Cedar Long")
        return value
    if isinstance(value, EntityRef):
        return {"__entity": value.to_json()}
    if isinstance(value, IpAddr):
        return {"__extn": {"fn": "ip", "arg": value.value}}
    if isinstance(value, Mapping):
        return {str(k): to_cedar_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_cedar_json(v) for v in value]
    raise PolicyError(f"cannot pass a {type(value).__name__} to Cedar: {value!r}")


@dataclass(frozen=True, slots=True)
class Entity:
    """One entity: its uid, attributes and parents (the ``in`` hierarchy)."""

    uid: EntityRef
    attrs: Mapping[str, CedarValue] = field(default_factory=dict)
    parents: tuple[EntityRef, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(self.parents))

    def to_json(self) -> dict[str, object]:
        return {
            "uid": self.uid.to_json(),
            "attrs": to_cedar_json(self.attrs),
            "parents": [p.to_json() for p in self.parents],
        }

    @classmethod
    def host(cls, name: str) -> Entity:
        """The Host entity for ``name``, with the ``name`` attribute permits match."""
        ref = EntityRef.host(name)
        return cls(ref, {"name": ref.id})

    @classmethod
    def workload(
        cls,
        workload_id: str,
        *,
        tenant: str,
        deployment: str,
        environment: str | None = None,
        artifact: str | None = None,
        run: str | None = None,
    ) -> Entity:
        """A run's workload, inside its deployment and tenant."""
        attrs: dict[str, CedarValue] = {}
        for key, value in (("environment", environment), ("artifact", artifact), ("run", run)):
            if value is not None:
                attrs[key] = value
        return cls(
            EntityRef.workload(workload_id),
            attrs,
            (EntityRef.deployment(tenant, deployment), EntityRef.tenant(tenant)),
        )

    @classmethod
    def deployment(cls, tenant: str, name: str, **attrs: str) -> Entity:
        return cls(EntityRef.deployment(tenant, name), dict(attrs), (EntityRef.tenant(tenant),))

    @classmethod
    def table(
        cls, tenant: str, dataset: str, table: str, *, synthetic: bool | None = None
    ) -> Entity:
        attrs: dict[str, CedarValue] = {} if synthetic is None else {"synthetic": synthetic}
        return cls(
            EntityRef.table(tenant, dataset, table),
            attrs,
            (EntityRef.dataset(tenant, dataset), EntityRef.tenant(tenant)),
        )

    @classmethod
    def in_tenant(cls, ref: EntityRef, tenant: str) -> Entity:
        """An attribute-less entity whose only parent is its tenant (secrets, buckets...)."""
        return cls(ref, {}, (EntityRef.tenant(tenant),))


@dataclass(frozen=True, slots=True)
class Request:
    """One question for the policy: may ``principal`` do ``action`` to ``resource``?"""

    principal: EntityRef
    action: str
    resource: EntityRef
    context: Mapping[str, CedarValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", qualify_action(self.action))

    def to_cedar(self) -> dict[str, object]:
        return {
            "principal": self.principal.to_json(),
            "action": {"type": f"{NAMESPACE}::Action", "id": self.action},
            "resource": self.resource.to_json(),
            "context": to_cedar_json(self.context),
        }


#: Additions one entity set keeps parsed (see :meth:`EntitySet.with_added`).
ADDED_KEPT = 256


class EntitySet:
    """Entities parsed (and checked against the schema) once, reusable across decisions.

    Build the stable part once, e.g. per run the workload with its deployment
    and tenant, and add the per-call part with :meth:`with_added`, which
    parses only the addition.
    """

    __slots__ = ("_added", "_handle")

    def __init__(self, entities: Iterable[Entity] = ()) -> None:
        text = _entities_json(entities)
        try:
            self._handle = cedarpy.Entities.from_json_str(text, schema_handle())
        except ValueError as exc:
            raise PolicyError(f"entities rejected by Cedar: {exc}") from exc
        self._added: dict[str, EntitySet] = {}

    @classmethod
    def _wrap(cls, handle: cedarpy.Entities) -> EntitySet:
        made = cls.__new__(cls)
        made._handle = handle
        made._added = {}
        return made

    def with_added(self, entities: Iterable[Entity]) -> EntitySet:
        """A new set: this one plus ``entities``. This set is unchanged.

        The last :data:`ADDED_KEPT` additions are kept: a run asks about the same
        few hosts, datasets and secrets again and again, and Cedar's parse of an
        addition costs about as much as the decision itself."""
        text = _entities_json(entities)
        hit = self._added.get(text)
        if hit is not None:
            return hit
        try:
            made = EntitySet._wrap(self._handle.with_added_json_str(text, schema_handle()))
        except ValueError as exc:
            raise PolicyError(f"entities rejected by Cedar: {exc}") from exc
        if len(self._added) >= ADDED_KEPT:
            self._added.clear()
        self._added[text] = made
        return made

    def __len__(self) -> int:
        return len(self._handle)


def _entities_json(entities: Iterable[Entity]) -> str:
    return json.dumps([e.to_json() for e in entities])
