"""Persistence behind one small interface.

Callers talk to a :class:`Store` and its :class:`Conn` with portable SQL
(``?`` placeholders, ``INSERT ... ON CONFLICT``), inside ``read()`` or
``write()`` transactions. Each engine owns its connections, its migrations and
its way of serialising writers: SQLite has one writer per process and a file
lock between processes; a PostgreSQL engine takes the advisory lock named by
``write(lock=...)``. Callers never see which engine they have: what differs is
asked of :attr:`Store.capabilities` (bulk inserts over arrays, secure deletion,
session locks) or of the store itself (:meth:`Store.unindexed`,
:meth:`Store.try_lock`, :meth:`Store.scrub`), and a write that loses to another
writer (a unique key taken, a serialization failure) raises :class:`Conflict` on
either engine. :class:`Engine` spells the engines' names, once. A store is copied
while it is written with its engine's own means (``copy_sqlite``, ``dump_postgres``:
``proctor backup``).
"""

from proctor.store._base import Capabilities, Conflict, Conn, Engine, Row, Store
from proctor.store._copy import check_dump, copy_sqlite, dump_postgres, restore_postgres
from proctor.store._open import open_store
from proctor.store._pgtext import redact, to_pg_sql

__all__ = [
    "Capabilities",
    "Conflict",
    "Conn",
    "Engine",
    "Row",
    "Store",
    "check_dump",
    "copy_sqlite",
    "dump_postgres",
    "open_store",
    "redact",
    "restore_postgres",
    "to_pg_sql",
]
