"""Kinds are types, spelled once: no module of src/proctor compares a value with an
environment's or a store engine's name, except the module that defines them.

An environment's rules live in ``governance/_environments.py`` (``Environment``,
``requires_quorum``, ``is_production``, ``environment_forbid``, ``bucket_dir``);
what an engine can do is asked of the store (``store.capabilities``,
``store.Conflict``, ``Store.event_field``, ``Store.try_lock``). A comparison
elsewhere is a second place where the rule could differ, which this test refuses.
"""

from __future__ import annotations

import ast
import itertools
from collections import Counter
from pathlib import Path

import pytest

from proctor.errors import UsageError
from proctor.governance import ENVIRONMENTS, Environment, environment_of
from proctor.store import Engine

SRC = Path(__file__).resolve().parents[2] / "src" / "proctor"

ENVIRONMENT_NAMES = frozenset(e.value for e in Environment)
ENGINE_NAMES = frozenset(e.value for e in Engine)

#: Where each kind of name is defined, and so may be compared.
DEFINED_IN: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(ENVIRONMENT_NAMES, ("governance/_environments.py",)),
    **dict.fromkeys(ENGINE_NAMES, ("store/",)),
}

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
    """Each comparison (==, !=, in, not in) of ``path`` with a kind's name, as (line, name)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for op, (left, right) in zip(node.ops, itertools.pairwise(sides), strict=True):
            if isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn):
                found.extend((node.lineno, name) for name in _names(left) + _names(right))
    return found


def _where(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def test_no_module_compares_an_environment_or_engine_name_it_does_not_define() -> None:
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
    )
    assert comparisons(sample) == [
        (1, "production"),
        (2, "sandbox"),
        (3, "postgresql"),
        (4, "sqlite"),
        (5, "sandbox"),
    ]


def test_an_environment_is_one_of_two_names_and_any_other_is_refused() -> None:
    assert environment_of("sandbox") is Environment.SANDBOX
    assert environment_of("production") is Environment.PRODUCTION
    assert set(ENVIRONMENTS) == ENVIRONMENT_NAMES
    for wrong in ("Production", "staging", "", "production "):
        with pytest.raises(UsageError, match="--env must be one of sandbox, production"):
            environment_of(wrong)
