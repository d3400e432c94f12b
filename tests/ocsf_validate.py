"""An OCSF event validator against the vendored official schema (tests/data/ocsf/).

It applies the rules of the official validators (the OCSF server's ``/api/v2/validate``
and ``ocsf-lib``'s checks) to one event:

- structure, by JSON Schema 2020-12 generated from the official compiled schema for
  the event's class *and the profiles it declares* (``ocsf-json-schema``, see
  tests/data/ocsf/README.md): required attributes, no attribute the class, its
  objects and its declared profiles do not define, ``*_id`` enums, ``class_uid`` /
  ``category_uid`` constants, the ``type_uid`` list, JSON types (timestamps and
  longs are integers);
- what JSON Schema does not carry, from the compiled dictionary: ``metadata.version``
  is the vendored version; each declared profile is one the class takes;
  ``type_uid = class_uid * 100 + activity_id``; an enum's caption sibling
  (``activity_name``, ``status``, ``user.type``...) is the caption of its id
  unless the id is 99 (Other); the classes' and objects' ``at_least_one`` /
  ``just_one`` constraints;
- warnings (not errors, as the official validator reports them): recommended
  attributes missing at the event's top level and in ``metadata``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

VERSION = "1.8.0"
ROOT = Path(__file__).parent / "data" / "ocsf" / VERSION


@dataclass
class Result:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@cache
def dictionary() -> dict[str, Any]:
    return dict(json.loads((ROOT / "dictionary.json").read_text()))


@cache
def _validator(name: str, profiles: tuple[str, ...]) -> Draft202012Validator | None:
    path = ROOT / ("+".join((name, *profiles)) + ".json")
    if not path.exists():
        return None
    return Draft202012Validator(json.loads(path.read_text()))


def _path(parts: Any) -> str:
    return ".".join(str(p) for p in parts) or "<event>"


def _constraints(obj: dict[str, Any], cons: dict[str, Any] | None, where: str, out: Result) -> None:
    cons = cons or {}
    if cons.get("at_least_one") and not any(n in obj for n in cons["at_least_one"]):
        out.errors.append(f"{where}: needs at least one of {cons['at_least_one']}")
    if cons.get("just_one") and sum(n in obj for n in cons["just_one"]) != 1:
        out.errors.append(f"{where}: needs exactly one of {cons['just_one']}")


def _walk(obj: dict[str, Any], attrs: dict[str, Any], where: str, out: Result) -> None:
    """Caption siblings and object constraints, recursively through object attributes."""
    objects = dictionary()["objects"]
    for name, value in obj.items():
        spec = attrs.get(name)
        if spec is None:
            continue  # an undefined attribute is JSON Schema's error
        enum, sibling = spec.get("enum") or {}, spec.get("sibling")
        caption = enum.get(str(value)) if str(value) != "99" else None
        if caption is not None and sibling in obj and obj[sibling] != caption:
            out.errors.append(
                f"{where}{sibling}: {obj[sibling]!r} is not the caption of "
                f"{name}={value} ({caption!r})"
            )
        kind = spec.get("object_type")
        if kind in objects and kind != "object":
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, dict):
                    at = f"{where}{name}[{i}]." if isinstance(value, list) else f"{where}{name}."
                    _constraints(item, _object_constraints(kind), at.rstrip("."), out)
                    _walk(item, objects[kind], at, out)


def _object_constraints(kind: str) -> dict[str, Any] | None:
    return dictionary().get("constraints", {}).get(kind)  # type: ignore[no-any-return]


def validate(event: Any) -> Result:
    """The errors and warnings of one OCSF event (a parsed JSON object)."""
    out = Result()
    if not isinstance(event, dict):
        out.errors.append("<event>: not a JSON object")
        return out
    cls = dictionary()["classes"].get(str(event.get("class_uid")))
    if cls is None:
        out.errors.append(f"class_uid: {event.get('class_uid')!r} is not a vendored class")
        return out
    metadata = event.get("metadata") if isinstance(event.get("metadata"), dict) else {}
    if metadata.get("version") != VERSION:
        out.errors.append(f"metadata.version: {metadata.get('version')!r} is not {VERSION}")
    declared = metadata.get("profiles", [])
    if not isinstance(declared, list) or not all(isinstance(p, str) for p in declared):
        out.errors.append("metadata.profiles: not a list of names")
        declared = []
    unknown = [p for p in declared if p not in cls["profiles"]]
    if unknown:
        out.errors.append(f"metadata.profiles: {unknown} not profiles of {cls['name']}")
    validator = _validator(cls["name"], tuple(sorted(set(declared) - set(unknown))))
    if validator is None:
        out.errors.append(f"metadata.profiles: no vendored schema for {sorted(declared)}")
        return out
    for err in sorted(validator.iter_errors(event), key=lambda e: list(e.absolute_path)):
        out.errors.append(f"{_path(err.absolute_path)}: {err.message}")
    activity = event.get("activity_id")
    if isinstance(activity, int) and event.get("type_uid") != cls_uid(event) * 100 + activity:
        out.errors.append(
            f"type_uid: {event.get('type_uid')!r} is not class_uid * 100 + activity_id"
        )
    _constraints(event, dictionary().get("class_constraints", {}).get(cls["name"]), "<event>", out)
    _walk(event, cls["attributes"], "", out)
    for name, spec in cls["attributes"].items():
        applies = not spec.get("profiles") or set(spec["profiles"]) & set(declared)
        if spec["requirement"] == "recommended" and name not in event and applies:
            out.warnings.append(f"{name}: recommended, missing")
    for name, spec in dictionary()["objects"]["metadata"].items():
        if spec["requirement"] == "recommended" and name not in metadata:
            out.warnings.append(f"metadata.{name}: recommended, missing")
    return out


def cls_uid(event: dict[str, Any]) -> int:
    return int(event["class_uid"])
