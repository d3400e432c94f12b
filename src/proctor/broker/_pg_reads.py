"""What a PostgreSQL statement reads, from its parse tree: the floor of the record.

A plan names what its scans output, and a scan under a Subquery Scan, a CTE
Scan or an Append outputs to a node that only names its own aliases; a
sub-select in a recursive CTE is not in ``EXPLAIN`` at all. The parse tree
(PostgreSQL's own parser, ``pglast``) names every reference, so every column
reference of the statement is resolved here to the base relation it reads,
through subqueries, CTEs (recursive too), set operations, ``LATERAL``,
functions in ``FROM``, whole-row references (``to_jsonb(c)``, ``c.*``,
``SELECT *``) and sub-selects in any clause. All of them count as read, whether
or not the outer query uses them: a subquery's select list, its ``WHERE``, its
``ORDER BY`` are read by the server when it runs. The plan's analysis is added
to this (it resolves what a view reads); a reference this analysis cannot
resolve refuses the statement (:class:`Unaccounted`): never allowed with fewer
columns than it reads.

Over-approximation is safe here (it can only deny, and the run's login grants
are what enforce); under-approximation is the bug this module exists against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pglast import ast as pgast
from pglast import enums as pgenums

#: Columns of a relation (schema, name) in order, or None if there is none.
ColumnsOf = Callable[[str, str], "list[str] | None"]


class Unaccounted(Exception):
    """The statement has a reference the analysis cannot resolve to what it reads."""


def table_name(schema: str, name: str) -> str:
    """A table as manifests, Cedar and events name it (``public`` left out)."""
    return name if schema == "public" else f"{schema}.{name}"


@dataclass
class _Item:
    """One item of a ``FROM`` list, seen by its name."""

    name: str
    table: str | None  # a base relation (as Cedar names it); None: derived
    # (visible name, base column or None); None: unknown (a function's output)
    columns: list[tuple[str, str | None]] | None
    # The base relations of a join with an alias (its columns are theirs).
    leaves: list[_Item] = field(default_factory=list)

    def column(self, name: str) -> tuple[bool, str | None]:
        """(whether the item has a column ``name``, the base column it is)."""
        if self.columns is None:
            return False, None
        for visible, base in self.columns:
            if visible == name:
                return True, base
        return False, None


@dataclass
class _Scope:
    parent: _Scope | None
    ctes: dict[str, list[str]]
    items: list[_Item] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def chain(self) -> Iterator[_Scope]:
        scope: _Scope | None = self
        while scope is not None:
            yield scope
            scope = scope.parent


def _names(values: Sequence[Any] | None) -> list[str]:
    return [str(v.sval) for v in values or () if isinstance(v, pgast.String)]


class StatementReads:
    """Walks one statement; ``reads`` is {table: columns} ("" for a table read
    with no column named, as ``count(*)``)."""

    def __init__(self, columns_of: ColumnsOf) -> None:
        self.columns_of = columns_of
        self.reads: dict[str, set[str]] = {}

    # -- statements ------------------------------------------------------------

    def select(self, node: pgast.SelectStmt, parent: _Scope | None) -> list[str]:
        """Analyse a SELECT (or set operation); return its output column names."""
        ctes = dict(parent.ctes) if parent is not None else {}
        scope = _Scope(parent, ctes)
        if node.withClause is not None:
            self._with(node.withClause, scope)
        if node.op != pgenums.SetOperation.SETOP_NONE:
            assert node.larg is not None and node.rarg is not None
            outputs = self.select(node.larg, scope)
            self.select(node.rarg, scope)
            scope.outputs = outputs
        elif node.valuesLists:
            for row in node.valuesLists:
                self.expr(row, scope)
            width = len(node.valuesLists[0]) if node.valuesLists else 0
            scope.outputs = [f"column{i + 1}" for i in range(width)]
        else:
            for item in node.fromClause or ():
                self._from(item, scope)
            scope.outputs = self._targets(node.targetList or (), scope)
            self.expr(node.whereClause, scope)
            self.expr(node.havingClause, scope)
            self.expr(node.windowClause, scope)
            self.expr(node.groupClause, scope, outputs=True)
            self.expr(node.distinctClause, scope, outputs=True)
        self.expr(node.sortClause, scope, outputs=True)
        self.expr(node.limitOffset, scope)
        self.expr(node.limitCount, scope)
        return scope.outputs

    def _with(self, clause: pgast.WithClause, scope: _Scope) -> None:
        for cte in clause.ctes or ():
            if not isinstance(cte, pgast.CommonTableExpr) or not isinstance(
                cte.ctequery, pgast.SelectStmt
            ):
                raise Unaccounted("a WITH that is not a SELECT")
            name = str(cte.ctename)
            query = cte.ctequery
            aliases = _names(cte.aliascolnames)
            if clause.recursive:
                # The recursive term may name the CTE: its columns are the first term's.
                first = query
                if query.op != pgenums.SetOperation.SETOP_NONE and query.larg is not None:
                    first = query.larg
                scope.ctes[name] = aliases or self.select(first, scope)
            outputs = self.select(query, scope)
            scope.ctes[name] = _renamed(outputs, aliases)
            if cte.search_clause is not None or cte.cycle_clause is not None:
                self.expr(cte.search_clause, scope)
                self.expr(cte.cycle_clause, scope)

    # -- FROM --------------------------------------------------------------------

    def _from(self, node: Any, scope: _Scope) -> list[_Item]:
        """Add the item(s) of one FROM entry to ``scope``; return them."""
        if isinstance(node, pgast.RangeVar):
            item = self._relation(node, scope)
            scope.items.append(item)
            return [item]
        if isinstance(node, pgast.RangeSubselect):
            item = self._subselect(node, scope)
            scope.items.append(item)
            return [item]
        if isinstance(node, pgast.RangeFunction):
            # Functions in FROM see the items before them (implicitly LATERAL).
            for entry in node.functions or ():
                self.expr(entry, scope)
            self.expr(node.coldeflist, scope)
            alias = node.alias
            name = str(alias.aliasname) if alias is not None else _function_name(node)
            item = _Item(name, None, None)
            scope.items.append(item)
            return [item]
        if isinstance(node, pgast.JoinExpr):
            return self._join(node, scope)
        if isinstance(node, pgast.RangeTableSample):
            self.expr(node.args, scope)
            self.expr(node.repeatable, scope)
            return self._from(node.relation, scope)
        raise Unaccounted(f"{type(node).__name__} in FROM")

    def _subselect(self, node: pgast.RangeSubselect, scope: _Scope) -> _Item:
        if not isinstance(node.subquery, pgast.SelectStmt):
            raise Unaccounted("a subquery in FROM that is not a SELECT")
        # Without LATERAL it sees the enclosing queries, not its siblings.
        seen = scope if node.lateral else _Scope(scope.parent, scope.ctes)
        outputs = self.select(node.subquery, seen)
        alias = node.alias
        name = str(alias.aliasname) if alias is not None else ""
        names = _renamed(outputs, _names(alias.colnames if alias is not None else None))
        return _Item(name, None, [(n, None) for n in names])

    def _join(self, node: pgast.JoinExpr, scope: _Scope) -> list[_Item]:
        if node.isNatural:
            raise Unaccounted("NATURAL JOIN compares columns it does not name: write USING or ON")
        left = self._from(node.larg, scope)
        right = self._from(node.rarg, scope)
        for using in _names(node.usingClause):
            for item in left + right:
                has, base = item.column(using)
                if has and item.table is not None and base is not None:
                    self._read(item.table, base)
        self.expr(node.quals, scope)
        items = left + right
        if node.alias is not None or node.join_using_alias is not None:
            alias = node.alias or node.join_using_alias
            assert alias is not None
            joined = _Item(str(alias.aliasname), None, None, leaves=items)
            scope.items.append(joined)
            items = [*items, joined]
        return items

    def _relation(self, node: pgast.RangeVar, scope: _Scope) -> _Item:
        relname = str(node.relname)
        schema = str(node.schemaname or "")
        alias = node.alias
        name = str(alias.aliasname) if alias is not None else relname
        renames = _names(alias.colnames if alias is not None else None)
        if not schema and relname in scope.ctes:
            names = _renamed(scope.ctes[relname], renames)
            return _Item(name, None, [(n, None) for n in names])
        if node.catalogname:
            raise Unaccounted("a relation of another database")
        columns = self.columns_of(schema or "public", relname)
        if columns is None:
            raise Unaccounted(f"the relation {relname} is not one the analysis can find")
        table = table_name(schema or "public", relname)
        self.reads.setdefault(table, set()).add("")
        visible = _renamed(columns, renames)
        return _Item(name, table, list(zip(visible, columns, strict=True)))

    # -- the select list ---------------------------------------------------------

    def _targets(self, targets: Sequence[Any], scope: _Scope) -> list[str]:
        outputs: list[str] = []
        for target in targets:
            if not isinstance(target, pgast.ResTarget):
                raise Unaccounted(f"{type(target).__name__} in a select list")
            value = target.val
            if isinstance(value, pgast.ColumnRef) and isinstance(
                (value.fields or (None,))[-1], pgast.A_Star
            ):
                outputs += self._star(value, scope)
                continue
            self.expr(value, scope)
            outputs.append(str(target.name) if target.name else _derived_name(value))
        return outputs

    def _star(self, ref: pgast.ColumnRef, scope: _Scope) -> list[str]:
        qualifier = _names((ref.fields or ())[:-1])
        if not qualifier:
            items = [i for i in scope.items if not i.leaves]
        else:
            items = [self._item(qualifier, scope)]
        names: list[str] = []
        for item in items:
            names += self._whole_row(item)
        return names

    # -- expressions ---------------------------------------------------------------

    def expr(self, node: Any, scope: _Scope, *, outputs: bool = False) -> None:
        """Every column reference and sub-select under ``node``."""
        if node is None or isinstance(node, str | int | float | bool):
            return
        if isinstance(node, list | tuple):
            for child in node:
                self.expr(child, scope, outputs=outputs)
            return
        if isinstance(node, pgast.ColumnRef):
            self._column_ref(node, scope, outputs=outputs)
            return
        if isinstance(node, pgast.SubLink):
            self.expr(node.testexpr, scope)
            if not isinstance(node.subselect, pgast.SelectStmt):
                raise Unaccounted("a sub-select that is not a SELECT")
            self.select(node.subselect, scope)
            return
        if isinstance(node, pgast.SelectStmt):
            self.select(node, scope)
            return
        if isinstance(node, pgast.Node):
            for slot in getattr(type(node), "__slots__", ()):
                if slot != "location":
                    self.expr(getattr(node, slot, None), scope, outputs=outputs)

    def _column_ref(self, ref: pgast.ColumnRef, scope: _Scope, *, outputs: bool) -> None:
        fields = list(ref.fields or ())
        if fields and isinstance(fields[-1], pgast.A_Star):
            self._star(ref, scope)
            return
        names = _names(fields)
        if len(names) != len(fields) or not names:
            raise Unaccounted("a column reference the analysis cannot read")
        if len(names) == 1:
            self._bare(names[0], scope, outputs=outputs)
            return
        try:
            item = self._item(names[:-1], scope)
        except Unaccounted:
            # (composite).field written as composite.field: the column is read.
            self._bare(names[0], scope, outputs=outputs)
            return
        self._member(item, names[-1])

    def _bare(self, name: str, scope: _Scope, *, outputs: bool) -> None:
        """A name without qualifier: a column of the innermost level that has it,
        else a whole-row reference to an item named so, else an output name."""
        maybe = False
        for level in scope.chain():
            found = False
            for item in level.items:
                if item.columns is None and not item.leaves:
                    maybe = True  # a function's output may be named so
                    continue
                has, base = item.column(name)
                if has:
                    found = True
                    if item.table is not None and base is not None:
                        self._read(item.table, base)
            if found:
                return
        for level in scope.chain():
            for item in level.items:
                if item.name == name:
                    self._whole_row(item)
                    return
        if (outputs and name in scope.outputs) or maybe:
            return
        raise Unaccounted(f"the name {name} is not one the analysis can resolve")

    def _member(self, item: _Item, name: str) -> None:
        if item.leaves:
            for leaf in item.leaves:
                has, base = leaf.column(name)
                if has and leaf.table is not None and base is not None:
                    self._read(leaf.table, base)
            return
        if item.columns is None:
            return  # a function's output column
        has, base = item.column(name)
        if not has:
            raise Unaccounted(f"{item.name}.{name} is not a column the analysis can find")
        if item.table is not None and base is not None:
            self._read(item.table, base)

    def _item(self, qualifier: list[str], scope: _Scope) -> _Item:
        name = qualifier[-1]
        for level in scope.chain():
            for item in level.items:
                if item.name == name and (
                    len(qualifier) == 1 or item.table == table_name(qualifier[-2], name)
                ):
                    return item
        raise Unaccounted(f"{'.'.join(qualifier)} is not a relation the analysis can find")

    def _whole_row(self, item: _Item) -> list[str]:
        """Every column of ``item`` is read (a derived item's were, inside it)."""
        if item.leaves:
            names: list[str] = []
            for leaf in item.leaves:
                names += self._whole_row(leaf)
            return names
        if item.columns is None:
            return ["?column?"]
        for _, base in item.columns:
            if item.table is not None and base is not None:
                self._read(item.table, base)
        return [visible for visible, _ in item.columns]

    def _read(self, table: str, column: str) -> None:
        self.reads.setdefault(table, set()).add(column)


def _renamed(names: list[str], renames: list[str]) -> list[str]:
    return renames + names[len(renames) :]


def _function_name(node: pgast.RangeFunction) -> str:
    for entry in node.functions or ():
        for part in entry if isinstance(entry, list | tuple) else (entry,):
            if isinstance(part, pgast.FuncCall):
                names = _names(part.funcname)
                return names[-1] if names else ""
    return ""


def _derived_name(node: Any) -> str:
    """The name PostgreSQL gives an unnamed select-list entry (what ORDER BY may use)."""
    if isinstance(node, pgast.ColumnRef):
        names = _names(node.fields)
        return names[-1] if names else "?column?"
    if isinstance(node, pgast.FuncCall):
        names = _names(node.funcname)
        return names[-1] if names else "?column?"
    if isinstance(node, pgast.TypeCast):
        inner = _derived_name(node.arg)
        if inner == "?column?" and node.typeName is not None:
            names = _names(node.typeName.names)
            return names[-1] if names else inner
        return inner
    return "?column?"


def statement_reads(stmt: pgast.SelectStmt, columns_of: ColumnsOf) -> dict[str, set[str]]:
    """{table: columns} every reference of ``stmt`` reads. Raises
    :class:`Unaccounted` for a reference it cannot resolve."""
    walker = StatementReads(columns_of)
    walker.select(stmt, None)
    return walker.reads
