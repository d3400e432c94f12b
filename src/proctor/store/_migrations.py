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
    # 3: governance: principals and their tokens, artifacts, approvals and quorum
    # rules, deployments (versioned, for rollback), and runs.
    [
        """CREATE TABLE principals (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            name TEXT NOT NULL,
            kind TEXT NOT NULL,
            roles TEXT NOT NULL,
            token_hash BLOB NOT NULL,
            created_at TEXT NOT NULL,
            created_by TEXT NOT NULL,
            disabled INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (tenant, name)
        )""",
        "CREATE UNIQUE INDEX principals_token ON principals (token_hash)",
        """CREATE TABLE artifacts (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            digest TEXT NOT NULL,
            name TEXT NOT NULL,
            manifest TEXT NOT NULL,
            capabilities_hash TEXT NOT NULL,
            purpose TEXT NOT NULL,
            author TEXT NOT NULL,
            submitted_at TEXT NOT NULL,
            size INTEGER NOT NULL,
            PRIMARY KEY (tenant, digest)
        )""",
        """CREATE TABLE artifact_files (
            digest TEXT NOT NULL,
            path TEXT NOT NULL,
            mode INTEGER NOT NULL,
            sha256 TEXT NOT NULL,
            size INTEGER NOT NULL,
            link TEXT,
            PRIMARY KEY (digest, path)
        ) WITHOUT ROWID""",
        """CREATE TABLE approvals (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL REFERENCES tenants (name),
            digest TEXT NOT NULL,
            capabilities_hash TEXT NOT NULL,
            purpose TEXT NOT NULL,
            principal TEXT NOT NULL,
            roles TEXT NOT NULL,
            decision TEXT NOT NULL,
            comment TEXT NOT NULL,
            created_at TEXT NOT NULL,
            expires_at TEXT,
            revoked_at TEXT,
            revoked_by TEXT,
            seq INTEGER NOT NULL
        )""",
        "CREATE INDEX approvals_digest ON approvals (tenant, digest)",
        """CREATE TABLE quorum_rules (
            tenant TEXT PRIMARY KEY REFERENCES tenants (name),
            required INTEGER NOT NULL,
            roles TEXT NOT NULL
        )""",
        """CREATE TABLE deployments (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            name TEXT NOT NULL,
            version INTEGER NOT NULL,
            digest TEXT NOT NULL,
            environment TEXT NOT NULL,
            mode TEXT NOT NULL,
            every_seconds REAL,
            instruction TEXT NOT NULL,
            reference TEXT NOT NULL,
            approvals TEXT NOT NULL,
            created_by TEXT NOT NULL,
            created_at TEXT NOT NULL,
            status TEXT NOT NULL,
            seq INTEGER NOT NULL,
            PRIMARY KEY (tenant, name, version)
        )""",
        """CREATE TABLE runs (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL REFERENCES tenants (name),
            deployment TEXT NOT NULL,
            version INTEGER NOT NULL,
            digest TEXT NOT NULL,
            environment TEXT NOT NULL,
            workload TEXT NOT NULL,
            approvals TEXT NOT NULL,
            backend TEXT NOT NULL,
            platform TEXT,
            status TEXT NOT NULL,
            reason TEXT,
            exit_code INTEGER,
            attempt INTEGER NOT NULL,
            limits TEXT NOT NULL,
            output_digest TEXT,
            started_at TEXT NOT NULL,
            ended_at TEXT,
            supervisor TEXT
        )""",
        "CREATE INDEX runs_by_deployment ON runs (tenant, deployment, started_at)",
    ],
    # 4: a dataset may be the synthetic twin of a real one: sandbox runs of an
    # artifact that names the real dataset read the twin instead.
    [
        "ALTER TABLE datasets ADD COLUMN twin_of TEXT",
    ],
    # 5: the subprocessor register (GDPR Art. 28(2)/(4)): who the tenant's data may
    # be sent to, for what, from where, and the hosts each one serves.
    [
        """CREATE TABLE subprocessors (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            name TEXT NOT NULL,
            purpose TEXT NOT NULL,
            location TEXT NOT NULL,
            hosts TEXT NOT NULL,
            created_at TEXT NOT NULL,
            created_by TEXT NOT NULL,
            PRIMARY KEY (tenant, name)
        )""",
    ],
    # 6: the sandbox environment, defined in one place (governance/_environments.py):
    # a secret may be the test twin of a real one, and the tenant names the hosts
    # its sandbox runs may reach.
    [
        "ALTER TABLE secrets ADD COLUMN twin_of TEXT",
        """CREATE TABLE sandbox_hosts (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            host TEXT NOT NULL,
            created_at TEXT NOT NULL,
            created_by TEXT NOT NULL,
            PRIMARY KEY (tenant, host)
        )""",
    ],
    # 7: governance events found by what they are about (governance/_backing.py): the
    # runtime and `audit verify` hold each store row to its event through this index,
    # never by reading the whole log. An index, not a table: no SQL statement can edit
    # it apart from the events it indexes. (Statement 1 is PostgreSQL's function.)
    [
        "SELECT 1",
        # json_valid first: a row whose bytes are not JSON (a tampered one) must stay
        # writable and readable, so that verification can name it.
        "CREATE INDEX ledger_entries_ref ON ledger_entries"
        " ((CASE WHEN json_valid(CAST(data AS TEXT))"
        " THEN json_extract(CAST(data AS TEXT), '$.resource') END), log)"
        " WHERE (CASE WHEN json_valid(CAST(data AS TEXT))"
        " THEN json_extract(CAST(data AS TEXT), '$.action') END) IN"
        " ('artifact.submit', 'approval.grant', 'approval.reject', 'approval.revoke',"
        " 'deployment.create', 'deployment.rollback', 'deployment.stopped', 'principal.create',"
        " 'principal.disable', 'principal.enable', 'token.issue', 'quorum.set',"
        " 'tenant.freeze', 'tenant.unfreeze')",
    ],
    # 8: a service or a schedule has at most one run at a time, whichever process or
    # node starts it: the store refuses a second 'running' row (lifecycle, Runs.insert).
    [
        "ALTER TABLE runs ADD COLUMN service TEXT",
        "CREATE UNIQUE INDEX runs_one_per_service ON runs (tenant, service)"
        " WHERE status = 'running' AND service IS NOT NULL",
    ],
    # 9: lineage objects (ledger/_objects.py): the per-row data of an event (the keyed
    # hashes of the rows a read returned), content-addressed and referenced from the
    # event by digest, count and Merkle root, so an event's size does not follow the
    # rows a call reads. ``ledger_lineage`` finds the events that read one key.
    [
        """CREATE TABLE ledger_objects (
            log TEXT NOT NULL,
            digest TEXT NOT NULL,
            data BLOB NOT NULL,
            PRIMARY KEY (log, digest)
        ) WITHOUT ROWID""",
        """CREATE TABLE ledger_lineage (
            log TEXT NOT NULL,
            key BLOB NOT NULL,
            seq INTEGER NOT NULL,
            PRIMARY KEY (log, key, seq)
        ) WITHOUT ROWID""",
    ],
    # 10: witnesses (witness/_tenant.py): the ones each tenant submits its checkpoints
    # to, its witness policy, and the cosignatures they returned (a note signature line
    # per log, checkpoint size and witness).
    [
        """CREATE TABLE tenant_witnesses (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            name TEXT NOT NULL,
            vkey TEXT NOT NULL,
            url TEXT NOT NULL,
            created_at TEXT NOT NULL,
            created_by TEXT NOT NULL,
            PRIMARY KEY (tenant, name)
        )""",
        """CREATE TABLE witness_policy (
            tenant TEXT PRIMARY KEY REFERENCES tenants (name),
            quorum INTEGER NOT NULL,
            max_age_seconds INTEGER NOT NULL
        )""",
        """CREATE TABLE witness_cosignatures (
            log TEXT NOT NULL,
            size INTEGER NOT NULL,
            witness TEXT NOT NULL,
            line TEXT NOT NULL,
            time TEXT NOT NULL,
            PRIMARY KEY (log, size, witness)
        ) WITHOUT ROWID""",
    ],
    # 11: retention per tenant and legal holds (governance/_retention.py): the period
    # past which an event's payload is pruned (its leaf hash stays), and the holds that
    # suspend pruning for a tenant, a deployment or a run. A hold is never deleted:
    # removing it stamps removed_at, so the history stays in the store as in the log.
    [
        """CREATE TABLE retention_rules (
            tenant TEXT PRIMARY KEY REFERENCES tenants (name),
            days INTEGER NOT NULL,
            below_minimum_reason TEXT,
            set_by TEXT NOT NULL,
            set_at TEXT NOT NULL
        )""",
        """CREATE TABLE legal_holds (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL REFERENCES tenants (name),
            scope TEXT NOT NULL,
            target TEXT NOT NULL,
            reason TEXT NOT NULL,
            created_by TEXT NOT NULL,
            created_at TEXT NOT NULL,
            removed_by TEXT,
            removed_at TEXT
        )""",
        "CREATE INDEX legal_holds_tenant ON legal_holds (tenant)",
    ],
    # 12: a tenant's ledger quota (governance/_tenants.py): the events its log takes a
    # (UTC) day before the broker refuses its runs' calls (no row: the default), and
    # the day's one refusal event, so that a restarted broker names it, not another.
    [
        """CREATE TABLE tenant_quotas (
            tenant TEXT PRIMARY KEY REFERENCES tenants (name),
            events_per_day INTEGER NOT NULL,
            set_by TEXT NOT NULL,
            set_at TEXT NOT NULL
        )""",
        """CREATE TABLE ledger_quota_refusals (
            tenant TEXT NOT NULL REFERENCES tenants (name),
            day TEXT NOT NULL,
            seq INTEGER NOT NULL,
            reason TEXT NOT NULL,
            PRIMARY KEY (tenant, day)
        )""",
    ],
    # 13: governance events found by what they are about through a column, not an
    # expression index: migration 7's index evaluated json_valid and json_extract over
    # every event's bytes at every insert (about a fifth of the ledger writer's time).
    # The ledger writes ``ref`` (the event's resource, for the governance actions
    # only: ledger.INDEXED_ACTIONS); the rows before it are filled from their bytes,
    # json_valid first so that a row whose bytes are not JSON (a tampered one) stays
    # readable and verification can name it. A store writer can edit ``ref`` as any
    # column: governance/_backing.py re-reads each event it finds, and ``verify``
    # holds every row's ``ref`` to its event.
    [
        "ALTER TABLE ledger_entries ADD COLUMN ref TEXT",
        "UPDATE ledger_entries SET ref = json_extract(CAST(data AS TEXT), '$.resource')"
        " WHERE (CASE WHEN json_valid(CAST(data AS TEXT))"
        " THEN json_extract(CAST(data AS TEXT), '$.action') END) IN"
        " ('artifact.submit', 'approval.grant', 'approval.reject', 'approval.revoke',"
        " 'deployment.create', 'deployment.rollback', 'deployment.stopped', 'principal.create',"
        " 'principal.disable', 'principal.enable', 'token.issue', 'quorum.set',"
        " 'tenant.freeze', 'tenant.unfreeze')"
        " AND (CASE WHEN json_valid(CAST(data AS TEXT))"
        " THEN json_type(CAST(data AS TEXT), '$.resource') END) = 'text'",
        "DROP INDEX ledger_entries_ref",
        "CREATE INDEX ledger_entries_ref ON ledger_entries (ref, log) WHERE ref IS NOT NULL",
    ],
    # 14: runtime nodes that share one store (issue 19). A node is one ``serve``
    # process; it holds a lease it renews, and a node whose lease has lapsed is dead
    # for every other. ``epoch`` is the fencing token: a node writes only while its
    # row is live with the epoch it registered at (lifecycle/_nodes.py), and the node
    # that finds it dead raises the epoch in the same statement that marks it.
    # ``lifecycle_claims``: who starts a service's next run or fires a schedule's
    # tick; the first insert wins, so each happens once across every node.
    [
        """CREATE TABLE nodes (
            id TEXT PRIMARY KEY,
            host TEXT NOT NULL,
            address TEXT,
            backends TEXT NOT NULL,
            capacity INTEGER NOT NULL,
            epoch INTEGER NOT NULL,
            state TEXT NOT NULL,
            started_at TEXT NOT NULL,
            lease_expires REAL NOT NULL
        )""",
        "CREATE INDEX nodes_state ON nodes (state, lease_expires)",
        """CREATE TABLE lifecycle_claims (
            tenant TEXT NOT NULL,
            deployment TEXT NOT NULL,
            slot TEXT NOT NULL,
            node TEXT NOT NULL,
            claimed_at TEXT NOT NULL,
            PRIMARY KEY (tenant, deployment, slot)
        )""",
        "CREATE INDEX lifecycle_claims_at ON lifecycle_claims (claimed_at)",
    ],
    # 15: run requests handed out through the store (issue 19): a run asked of one
    # node's API is queued, and a node with room takes it (FOR UPDATE SKIP LOCKED on
    # PostgreSQL); the requester follows it by its run id, whichever node runs it.
    [
        """CREATE TABLE run_requests (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            deployment TEXT NOT NULL,
            actor TEXT NOT NULL,
            state TEXT NOT NULL,
            node TEXT,
            run_id TEXT,
            error TEXT,
            created_at TEXT NOT NULL,
            taken_at TEXT,
            done_at TEXT
        )""",
        "CREATE INDEX run_requests_state ON run_requests (state, created_at)",
    ],
    # 16: the web console's sessions and OIDC sign-ins under way, kept in the store so
    # that any node answers a person's next page (api/_console_shelf.py). Keyed by
    # hashes; each row sealed with a key derived from the home's runtime key.
    [
        """CREATE TABLE console_sessions (
            key TEXT PRIMARY KEY,
            doc BLOB NOT NULL,
            seen_at REAL NOT NULL,
            expires_at REAL NOT NULL
        )""",
        """CREATE TABLE console_signins (
            key TEXT PRIMARY KEY,
            doc BLOB NOT NULL,
            created REAL NOT NULL
        )""",
    ],
    # 17: requests for approval (issue 35): an agent or a developer asks the approvers
    # for a digest, with a comment. The request's ledger event is the record (seq);
    # the row is what the approval state reads (the approvals are read from events).
    # And the person or team responsible for an agent principal.
    [
        """CREATE TABLE approval_requests (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            digest TEXT NOT NULL,
            principal TEXT NOT NULL,
            comment TEXT NOT NULL,
            created_at TEXT NOT NULL,
            seq INTEGER NOT NULL
        )""",
        "CREATE INDEX approval_requests_digest ON approval_requests (tenant, digest, created_at)",
        # An agent's principal names the person or team answerable for it.
        "ALTER TABLE principals ADD COLUMN responsible TEXT",
    ],
    # 18: calls waiting for a person (issue 35, capabilities marked ``ask``): one row per
    # asked call, its exact arguments, its state (pending until exactly one answer
    # moves it, compare-and-swap on state in the answer event's transaction), and the
    # seqs of the ``call.ask`` and ``call.answer`` events that record it.
    [
        """CREATE TABLE asks (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            run_id TEXT NOT NULL,
            deployment TEXT NOT NULL,
            artifact TEXT,
            action TEXT NOT NULL,
            resource TEXT NOT NULL,
            arguments TEXT NOT NULL,
            state TEXT NOT NULL,
            created_at TEXT NOT NULL,
            deadline TEXT NOT NULL,
            ask_seq INTEGER,
            answered_by TEXT,
            answered_at TEXT,
            answer_seq INTEGER,
            comment TEXT
        )""",
        "CREATE INDEX asks_tenant_state ON asks (tenant, state, created_at)",
        "CREATE INDEX asks_run ON asks (run_id)",
    ],
]
