"""Regenerate tests/data/ocsf/<version>/ from the official compiled OCSF schema.

Run from the repository root (needs the ``ocsf-json-schema`` package, which
bundles the schema server's compiled export of each released OCSF version and
generates JSON Schema from it):

    .venv/bin/pip install 'ocsf-json-schema==1.2.0'
    .venv/bin/python tests/data/ocsf/make_schema.py 1.8.0

Writes, for each class Proctor maps to and each profile set it may declare:
``<class>.json`` (no profile) and ``<class>+<p1>+<p2>.json`` (JSON Schema 2020-12,
self-contained), and ``dictionary.json``: per class and object, each
attribute's type, object type, requirement and enum captions, which JSON Schema
cannot express (the ``*_id`` / caption pairs, recommended attributes).
"""

from __future__ import annotations

import json
import sys
from itertools import combinations
from pathlib import Path
from typing import Any

from ocsf_json_schema import OcsfJsonSchemaEmbedded, get_ocsf_schema  # type: ignore[import-untyped]

CLASSES = ("api_activity", "datastore_activity", "http_activity", "network_activity")
# Every subset of these is vendored, so a line declaring fewer (or other) profiles
# than its attributes need is judged by the schema of what it declares.
PROFILES = ("host", "security_control")


def _attrs(attributes: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, a in attributes.items():
        entry: dict[str, Any] = {"type": a.get("type"), "requirement": a.get("requirement")}
        if a.get("object_type"):
            entry["object_type"] = a["object_type"]
        if a.get("is_array"):
            entry["is_array"] = True
        if a.get("profiles"):
            entry["profiles"] = a["profiles"]
        if a.get("sibling"):
            entry["sibling"] = a["sibling"]
        if a.get("enum"):
            entry["enum"] = {k: v.get("caption") for k, v in a["enum"].items()}
        out[name] = entry
    return out


def main(version: str) -> None:
    compiled = get_ocsf_schema(version)
    assert compiled["version"] == version, compiled["version"]
    gen = OcsfJsonSchemaEmbedded(compiled)
    out = Path(__file__).parent / version
    out.mkdir(exist_ok=True)
    for name in CLASSES:
        for n in range(len(PROFILES) + 1):
            for chosen in combinations(PROFILES, n):
                doc = gen.get_class_schema(name, list(chosen))
                path = out / ("+".join((name, *chosen)) + ".json")
                path.write_text(json.dumps(doc, sort_keys=True) + "\n")
    dictionary = {
        "version": version,
        "classes": {
            str(compiled["classes"][c]["uid"]): {
                "name": c,
                "caption": compiled["classes"][c]["caption"],
                "category_uid": compiled["classes"][c].get("category_uid"),
                "profiles": compiled["classes"][c].get("profiles", []),
                "attributes": _attrs(compiled["classes"][c]["attributes"]),
            }
            for c in CLASSES
        },
        "objects": {o: _attrs(d["attributes"]) for o, d in sorted(compiled["objects"].items())},
        "constraints": {
            o: d["constraints"]
            for o, d in sorted(compiled["objects"].items())
            if d.get("constraints")
        },
        "class_constraints": {
            c: compiled["classes"][c]["constraints"]
            for c in CLASSES
            if compiled["classes"][c].get("constraints")
        },
    }
    (out / "dictionary.json").write_text(json.dumps(dictionary, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
