"""Versioned schema migrations, one list per engine.

Migration N is ``MIGRATIONS[N - 1]``; a store records every version it applied
in ``schema_migrations``. Never edit a released migration: append a new one.
"""

from __future__ import annotations

SQLITE_MIGRATIONS: list[list[str]] = [
    # 1: runtime metadata, tenants, and the ledger's logs.
    [
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE tenants (
            name TEXT PRIMARY KEY,
            created_at TEXT NOT NULL,
            created_by TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'active'
        )""",
        # One row per log: its head (size, root) and the latest signed checkpoint.
        """CREATE TABLE ledger_logs (
            log TEXT PRIMARY KEY,
            origin TEXT NOT NULL,
            size INTEGER NOT NULL,
            root BLOB NOT NULL,
            last_time TEXT NOT NULL,
            checkpoint TEXT NOT NULL
        )""",
        # The event bytes exactly as hashed. ``time`` duplicates the event's own
        # field so that period queries use an index; verification never trusts it.
        """CREATE TABLE ledger_entries (
            log TEXT NOT NULL,
            seq INTEGER NOT NULL,
            time TEXT NOT NULL,
            data BLOB NOT NULL,
            PRIMARY KEY (log, seq)
        ) WITHOUT ROWID""",
        "CREATE INDEX ledger_entries_time ON ledger_entries (log, time)",
        # C2SP tlog-tiles: level L, index N holds up to 256 hashes of subtrees of
        # 256^L leaves. A partial tile only ever grows, so any earlier tree size can
        # still be proven from the stored tiles.
        """CREATE TABLE ledger_tiles (
            log TEXT NOT NULL,
            level INTEGER NOT NULL,
            idx INTEGER NOT NULL,
            hashes BLOB NOT NULL,
            PRIMARY KEY (log, level, idx)
        ) WITHOUT ROWID""",
        """CREATE TABLE ledger_checkpoints (
            log TEXT NOT NULL,
            size INTEGER NOT NULL,
            time TEXT NOT NULL,
            note TEXT NOT NULL,
            PRIMARY KEY (log, size)
        ) WITHOUT ROWID""",
    ],
    # 2: per-tenant policies (versioned by content hash), and the resources the
    # broker mediates: datasets, secrets (encrypted at rest), buckets.
    [
        """CREATE TABLE policies (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            version TEXT NOT NULL,
            text TEXT NOT NULL,
            set_at TEXT NOT NULL,
            set_by TEXT NOT NULL,
            seq INTEGER NOT NULL,
            PRIMARY KEY (tenant, seq)
        )""",
        """CREATE TABLE datasets (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            name TEXT NOT NULL,
            kind TEXT NOT NULL,
            location TEXT NOT NULL,
            synthetic INTEGER NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (tenant, name)
        )""",
        """CREATE TABLE secrets (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            name TEXT NOT NULL,
            sealed BLOB NOT NULL,
            hosts TEXT NOT NULL,
            header TEXT NOT NULL,
            template TEXT NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (tenant, name)
        )""",
        """CREATE TABLE buckets (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            name TEXT NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (tenant, name)
        )""",
    ],
]
