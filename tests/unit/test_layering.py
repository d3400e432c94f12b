"""The components of src/proctor import only down the documented order, and only
each other's public surface.

The order, bottom to top (a component may import any component below it):

    errors; telemetry; store; ledger; witness; policy; sandbox; guest; governance; broker;
    lifecycle; evidence; runtime; backup; client; console; mcp; api; cli; testing

- ``guest`` is standard library only: inside a sandbox it is the package
  ``proctor_guest``, so it imports nothing of proctor (its modules import each
  other relatively).
- ``runtime`` (runtime.py) opens a home and wires the components: lifecycle and
  evidence take ``proctor.governance.Home``, a Protocol it satisfies, instead of
  importing it; api and cli use it.
- ``client`` (the SDK) may import only ``errors`` and its own modules, so that a
  client process loads no server code.
- ``console`` (the web console) may import only ``errors`` and ``client``: it
  acts through the SDK as the signed-in person and cannot decide anything itself.
- ``mcp`` (the MCP server) likewise: each tool is an SDK call made as the agent.
- The package root (``proctor/__init__``) imports only ``errors`` eagerly, and
  the client lazily.

Every import counts: top-level, inside functions, and under TYPE_CHECKING.
Another component's private module (``proctor.X._y``, imported from outside
``proctor.X``) is refused everywhere.

docs/architecture.md's components table is held to the same imports: its rows in
this order, and each row's "built on" naming exactly the components it imports.
Only ``runtime.py`` builds a ``Supervisor``; everyone else asks ``Runtime.supervisor``.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "proctor"

ORDER = [
    "errors", "telemetry", "store", "ledger", "witness", "policy", "sandbox", "guest", "governance", "broker",
    "lifecycle", "evidence", "runtime", "backup", "client", "console", "mcp", "api", "cli",
    "testing",
]  # fmt: skip

#: Components allowed to import only some of those below them.
ONLY = {"guest": set[str](), "client": {"errors"}, "console": {"errors", "client"},
        "mcp": {"errors", "client"}}  # fmt: skip

#: Edges that break the rules today, each with why it is allowed (aim: none).
ALLOWED: dict[tuple[str, str], str] = {}


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """Every proctor module ``path`` imports (``source``: its text, if not read from
    it), anywhere in it, absolute names."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    text = path.read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # `from proctor import telemetry` imports the component telemetry
            if target == "proctor":
                found += [(f"proctor.{a.name}", node.lineno) for a in node.names
                          if a.name in ORDER]  # fmt: skip
            # `from proctor.x import _y` names a private module too
            found += [(f"{target}.{a.name}", node.lineno) for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]  # fmt: skip
    return [(t, line) for t, line in found if t == "proctor" or t.startswith("proctor.")]


def _edges() -> list[tuple[str, str, int, str]]:
    """(importer, imported, line, component of the importer) for every module."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module(path)
        out += [(module, target, line, _component(module)) for target, line in _imports(path)]
    return out


def _problem(src: str, dst: str, here: str) -> str | None:
    there = _component(dst)
    if here == there:
        return None
    if any(p.startswith("_") for p in dst.split(".")[2:]):
        return "imports another component's private module"
    if here == "":
        return None if there == "errors" or dst == "proctor.client" else "root imports it"
    if there == "":
        return None  # the root's __version__: it loads nothing else eagerly
    if here in ONLY and there not in ONLY[here]:
        return f"{here} may import only {sorted(ONLY[here]) or 'nothing of proctor'}"
    if ORDER.index(there) > ORDER.index(here):
        return f"points up the order ({here} is below {there})"
    return None


def test_every_component_is_in_the_order() -> None:
    found = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists())
             or (p.suffix == ".py" and p.stem != "__init__")}  # fmt: skip
    assert found == set(ORDER)


def test_imports_point_down_the_order_and_at_public_surfaces() -> None:
    bad = []
    for src, dst, line, here in _edges():
        why = _problem(src, dst, here)
        if why is not None and (src, dst) not in ALLOWED:
            bad.append(f"{src}:{line} -> {dst}: {why}")
    assert bad == []


def test_allowed_exceptions_are_still_needed() -> None:
    edges = {(src, dst) for src, dst, _, _ in _edges()}
    assert set(ALLOWED) <= edges, "an allowed exception is gone: remove it from ALLOWED"


def test_the_checker_sees_what_it_must() -> None:
    assert _problem("proctor.lifecycle._x", "proctor.evidence", "lifecycle")
    assert _problem("proctor.evidence._x", "proctor.governance._runs", "evidence")
    assert _problem("proctor.guest.shim", "proctor.errors", "guest")
    assert _problem("proctor.client._client", "proctor.governance", "client")
    assert _problem("proctor.cli._x", "proctor.broker", "cli") is None
    assert _problem("proctor.broker._x", "proctor.guest.protocol", "broker") is None
    # `from proctor import X` names the component X
    found = _imports(SRC / "cli" / "_x.py", "from proctor import api, __version__\n")
    assert ("proctor.api", 1) in found and ("proctor.__version__", 1) not in found


def test_a_client_process_loads_no_server_code() -> None:
    """``import proctor.client`` (and an error answer mapped to its class) must not
    import the web framework, Cedar, or any server component: measured in a fresh
    interpreter, as a user's process would load it."""
    import json
    import subprocess
    import sys

    probe = (
        "import json, sys\n"
        "import proctor.client\n"
        "from proctor.errors import class_of\n"
        "cls = class_of('run_refused')\n"
        "print(json.dumps([cls.__name__, sorted(sys.modules)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    name, modules = json.loads(out)
    assert name == "RunRefused"
    server = ("fastapi", "starlette", "uvicorn", "cedarpy", "psycopg")
    server += tuple(
        f"proctor.{c}" for c in ("sandbox", "broker", "governance", "lifecycle", "api", "runtime")
    )
    loaded = sorted(m for m in modules if m.split(".")[0] in server or m.startswith(server))
    assert loaded == [], f"a client process loaded server code: {loaded}"


# -- the "built on" column of docs/architecture.md -------------------------------------

ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"


def _built_on(text: str) -> list[tuple[str, set[str]]]:
    """The components table under "Components, bottom to top": each row's component
    and the components its "built on" cell names (``—`` none; a parenthesis is a note)."""
    lines = text.split("## Components, bottom to top", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[start:])
    rows = [line for line in table if line.startswith("| `")]
    out = []
    for row in rows:
        name = row.split("`")[1].removesuffix("/").removesuffix(".py")
        cell = re.sub(r"\([^)]*\)", "", row.rstrip().removesuffix("|").rpartition("|")[2])
        names = {n.strip() for n in cell.split(",")} - {"—", ""}
        assert names <= set(ORDER), f"{name}: 'built on' names {sorted(names - set(ORDER))}"
        out.append((name, names))
    return out


def _imported() -> dict[str, set[str]]:
    """Each component's imports of the other components, from every module of it."""
    found: dict[str, set[str]] = {c: set() for c in ORDER}
    for _, dst, _, here in _edges():
        there = _component(dst)
        if here and there and there != here:
            found[here].add(there)
    return found


def _column_errors(listed: list[tuple[str, set[str]]], imported: dict[str, set[str]]) -> list[str]:
    bad = []
    if [name for name, _ in listed] != ORDER:
        bad.append(f"the table's rows are {[n for n, _ in listed]}, not the order {ORDER}")
    for name, names in listed:
        uses = imported.get(name, set())
        bad += [f"{name} imports {c}, not in its 'built on'" for c in sorted(uses - names)]
        bad += [f"{name}'s 'built on' names {c}, never imported" for c in sorted(names - uses)]
    return bad


def test_the_built_on_column_is_the_imports() -> None:
    listed = _built_on(ARCHITECTURE.read_text(encoding="utf-8"))
    assert _column_errors(listed, _imported()) == [], "fix docs/architecture.md's table"


def test_the_built_on_check_sees_what_it_must() -> None:
    table = (
        "## Components, bottom to top\n\nA component may import ...\n\n"
        "| component | owns | built on |\n|---|---|---|\n"
        "| `errors.py` | the root | — |\n| `store/` | rows | errors (sqlite3) |\n"
        "| `ledger/` | logs, `a|b` | store |\n\nAfter the table.\n"
    )
    listed = _built_on(table)
    assert listed == [("errors", set()), ("store", {"errors"}), ("ledger", {"store"})]
    uses = {"errors": set(), "store": {"errors"}, "ledger": {"errors", "store"}}
    bad = _column_errors(listed, uses)
    assert "ledger imports errors, not in its 'built on'" in bad
    assert bad[0].startswith("the table's rows are")  # three rows, not the whole order
    bad = _column_errors(listed, {"errors": set(), "store": set(), "ledger": {"store"}})
    assert "store's 'built on' names errors, never imported" in bad


# -- one place builds a Supervisor ----------------------------------------------------

#: The one module that builds a ``proctor.lifecycle.Supervisor`` (``Runtime.supervisor``);
#: the API, the CLI, ``serve`` and the demo ask it, so a run starts one way everywhere.
SUPERVISOR_BUILDER = SRC / "runtime.py"


def _supervisor_builds(source: str) -> list[int]:
    """Lines of ``source`` that call ``Supervisor(...)`` or ``x.Supervisor(...)``, or
    import it under another name (which could then be called unseen)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")) == "Supervisor":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(
            a.name == "Supervisor" and a.asname not in (None, "Supervisor") for a in node.names
        ):
            lines.append(node.lineno)
    return lines


def test_only_the_runtime_builds_a_supervisor() -> None:
    bad = [f"{path.relative_to(SRC.parent)}:{line}"
           for path in sorted(SRC.rglob("*.py")) if path != SUPERVISOR_BUILDER
           for line in _supervisor_builds(path.read_text(encoding="utf-8"))]  # fmt: skip
    assert bad == [], "build it through Runtime.supervisor(broker, backend)"
    assert _supervisor_builds(SUPERVISOR_BUILDER.read_text(encoding="utf-8")), "moved?"


def test_the_supervisor_check_sees_what_it_must() -> None:
    assert _supervisor_builds("sup = Supervisor(rt, broker, backend)\n") == [1]
    assert _supervisor_builds("x = lifecycle.Supervisor(rt, b)\n") == [1]
    assert _supervisor_builds("from proctor.lifecycle import Supervisor as S\n") == [1]
    assert _supervisor_builds("sup = rt.supervisor(broker, backend)\n") == []
    assert _supervisor_builds("def f(s: Supervisor) -> None: ...\n") == []
