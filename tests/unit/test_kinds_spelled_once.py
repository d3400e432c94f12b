"""Kinds are types, spelled once: no module of src/proctor compares a value with an
environment's, a store engine's or a dataset kind's name, except the module that
defines them; nor keys a table by such a name (a lookup is a comparison too).

An environment's rules live in ``governance/_environments.py`` (``Environment``,
``requires_quorum``, ``is_production``, ``environment_forbid``, ``bucket_dir``);
what an engine can do is asked of the store (``store.capabilities``,
``store.Conflict``, ``Store.unindexed``, ``Store.try_lock``). A comparison
elsewhere is a second place where the rule could differ, which this test refuses.
A dataset's kind is ``governance.DatasetKind`` (``governance/_resources.py``); the
broker's registries (``_connectors._CONNECTORS``, ``_exposure._EXPOSURE``) key on
its members. Its names are the engines' names too, so a comparison with
``"sqlite"`` is allowed only where either is defined.
"""

from __future__ import annotations

import ast
import itertools
from collections import Counter
from pathlib import Path

import pytest

from proctor.broker import _connectors, _exposure
from proctor.errors import UsageError
from proctor.governance import ENVIRONMENTS, DatasetKind, Environment, environment_of
from proctor.store import Engine

SRC = Path(__file__).resolve().parents[2] / "src" / "proctor"

ENVIRONMENT_NAMES = frozenset(e.value for e in Environment)
ENGINE_NAMES = frozenset(e.value for e in Engine)
DATASET_KIND_NAMES = frozenset(k.value for k in DatasetKind)

#: Where each kind of name is defined, and so may be compared.
DEFINED_IN: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(ENVIRONMENT_NAMES, ("governance/_environments.py",)),
    **dict.fromkeys(ENGINE_NAMES, ("store/",)),
}
for _name in DATASET_KIND_NAMES:
    DEFINED_IN[_name] = (*DEFINED_IN.get(_name, ()), "governance/_resources.py")

#: Comparisons left in modules being rebuilt by other work, by file and how many
#: names they spell (``in ("sandbox", "production")`` counts two).
#: Each goes when its module is rebuilt; the count may shrink, never grow.
LEFT: dict[str, int] = {}


def _names(node: ast.expr) -> list[str]:
    """The kind names a side of a comparison spells: a string, or a literal
    tuple, list or set of strings (``x in ("sandbox", "production")``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in DEFINED_IN else []
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [n for e in node.elts for n in _names(e)]
    return []


def comparisons(path: Path) -> list[tuple[int, str]]:
    """Each comparison (==, !=, in, not in) of ``path`` with a kind's name, and each
    table keyed by one (``{"postgresql": ...}``, ``case "sqlite":``), as (line, name)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Dict):
            found.extend(
                (key.lineno, name) for key in node.keys if key is not None for name in _names(key)
            )
            continue
        if isinstance(node, ast.MatchValue):
            found.extend((node.lineno, name) for name in _names(node.value))
            continue
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for op, (left, right) in zip(node.ops, itertools.pairwise(sides), strict=True):
            if isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn):
                found.extend((node.lineno, name) for name in _names(left) + _names(right))
    return found


def _where(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def test_no_module_compares_a_kind_name_it_does_not_define() -> None:
    stray: list[str] = []
    left: Counter[str] = Counter()
    for path in sorted(SRC.rglob("*.py")):
        where = _where(path)
        for line, name in comparisons(path):
            if where.startswith(DEFINED_IN[name]):
                continue
            if where in LEFT:
                left[where] += 1
                continue
            stray.append(f"src/proctor/{where}:{line} compares with {name!r}")
    assert not stray, (
        "ask governance/_environments.py's rules or the store's capabilities instead:\n"
        + "\n".join(stray)
    )
    grown = {w: n for w, n in left.items() if n > LEFT[w]}
    assert not grown, f"more comparisons than were left in: {grown}"


def test_the_check_finds_every_spelling_it_refuses(tmp_path: Path) -> None:
    """The scan itself: each form is found, and a rule's call is not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "a = env == 'production'\n"
        "b = 'sandbox' != env\n"
        'c = store.engine == "postgresql"\n'
        "d = kind in ('sqlite', 'other')\n"
        "e = x < y == 'sandbox'\n"
        "f = is_production(env)\n"
        "g = env == Environment.PRODUCTION\n"
        "h = env == 'staging'\n"
        "i = {'postgresql': connect, 'other': 1}\n"
        "j = {DatasetKind.SQLITE: connect}\n"
        "match kind:\n"
        "    case 'sqlite':\n"
        "        pass\n"
        "k = {'kind': 'sqlite'}\n"
    )
    assert sorted(comparisons(sample)) == [
        (1, "production"),
        (2, "sandbox"),
        (3, "postgresql"),
        (4, "sqlite"),
        (5, "sandbox"),
        (9, "postgresql"),
        (12, "sqlite"),
    ]


def test_a_dataset_kind_is_defined_once_and_each_has_its_connector() -> None:
    """The broker's registries key on DatasetKind's members: every kind has a
    connector (and the connector says it is that kind), none is keyed by a name."""
    assert DatasetKind("sqlite") is DatasetKind.SQLITE
    assert DatasetKind("postgresql") is DatasetKind.POSTGRESQL
    assert set(_connectors._CONNECTORS) == set(DatasetKind)
    assert all(type(k) is DatasetKind for k in _connectors._CONNECTORS)
    assert all(type(k) is DatasetKind for k in _exposure._EXPOSURE)
    for kind, load in _connectors._CONNECTORS.items():
        assert load().kind is kind


def test_an_environment_is_one_of_two_names_and_any_other_is_refused() -> None:
    assert environment_of("sandbox") is Environment.SANDBOX
    assert environment_of("production") is Environment.PRODUCTION
    assert set(ENVIRONMENTS) == ENVIRONMENT_NAMES
    for wrong in ("Production", "staging", "", "production "):
        with pytest.raises(UsageError, match="--env must be one of sandbox, production"):
            environment_of(wrong)
