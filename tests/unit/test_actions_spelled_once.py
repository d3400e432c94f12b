"""An event's action is spelled once, in ``ledger/_actions.py`` (``ledger.Action``);
every other module of src/proctor writes and compares the members.

A second spelling is a name that can drift: a verifier looking for an action no
writer uses any more finds nothing and passes. This test finds every string
literal equal to an action's name outside the module that defines them.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from proctor.ledger import PRUNE_ACTION, PRUNED_ACTION, Action, canonical_json
from proctor.policy import ACTIONS

SRC = Path(__file__).resolve().parents[2] / "src" / "proctor"
NAMES = frozenset(a.value for a in Action)

#: Modules that spell the same text as something else, not an event's action.
NOT_ACTIONS = {
    # ASGI's message type "http.request", not the broker's egress event.
    "api/_app.py",
    # serve's JSON log lines (lifecycle/_jsonlog.py), named like the events they follow.
    "lifecycle/_serve.py",
}

#: The Cedar schema spells the actions for Cedar; policy/ sits below the ledger and
#: may not import it, so the test below holds the two equal instead.
CEDAR = ("policy/",)

#: Spellings left in modules that other work is rebuilding, by file and how many.
#: Each goes when its module is rebuilt; the count may shrink, never grow.
LEFT: dict[str, int] = {}


def spellings(path: Path) -> list[tuple[int, str]]:
    """Each string literal of ``path`` that is an action's name, as (line, name)."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
    ]


def test_no_module_spells_an_action_it_does_not_define() -> None:
    stray: list[str] = []
    left: Counter[str] = Counter()
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where == "ledger/_actions.py" or where in NOT_ACTIONS or where.startswith(CEDAR):
            continue
        for line, name in spellings(path):
            if where in LEFT:
                left[where] += 1
            else:
                stray.append(f"src/proctor/{where}:{line} spells {name!r}")
    assert not stray, "use proctor.ledger.Action instead:\n" + "\n".join(stray)
    grown = {w: n for w, n in left.items() if n > LEFT[w]}
    assert not grown, f"more spellings than were left in: {grown}"


def test_every_cedar_action_is_an_event_action() -> None:
    """A call is decided under its Cedar action and recorded under the same name; a
    refused control-plane call is recorded under the action it asked for."""
    assert set(ACTIONS) <= NAMES, sorted(set(ACTIONS) - NAMES)


def test_a_member_is_its_name_in_an_event_and_every_comparison() -> None:
    assert canonical_json({"action": Action.HTTP_REQUEST}) == b'{"action":"http.request"}'
    assert f"{Action.RUN_START}" == "run.start"
    assert {Action.SQL_SELECT: 1}.get("sql.select") == 1
    assert (PRUNE_ACTION, PRUNED_ACTION) == ("retention.prune", "ledger.pruned")
    # Names are unique: no two members are one action.
    assert len(NAMES) == len(Action)


def test_the_scan_finds_a_spelling_and_not_a_member(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "a = EventDraft(actor, 'run.start', 'run/x')\n"
        "b = ev['action'] == \"http.request\"\n"
        "c = Action.RUN_END\n"
        "d = 'run.start.extra'\n"
    )
    assert spellings(sample) == [(1, "run.start"), (2, "http.request")]
