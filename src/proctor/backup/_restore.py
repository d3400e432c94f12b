"""``proctor restore DIR --home NEW``: a working home made from a backup.

The backup is verified first, and each file is checked again as it is copied.
The new home's paths are its own: its SQLite store is ``proctor.db`` in it, named
relative to it in ``config.json`` (a copied home once wrote to the original's
database); a PostgreSQL home's dump goes into the new, empty database given with
``--store``, never into one that holds a store. Nothing of the original home is
opened. Before ``config.json`` is written (its presence makes the directory a
home), the new home's ledger is verified with its own runtime: each log ends at
the backup's checkpoint, every store row of every tenant is backed by the log.

``restored.json`` records where each log stood: verification that asks the
witnesses reads it to say how far the restored log is behind what they cosigned
(:func:`behind_witnesses`).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctor.backup._check import BackupReport, verify_backup
from proctor.backup._files import copy_hashed, make_dir
from proctor.backup._manifest import HOME, Manifest
from proctor.errors import UsageError, VerificationFailed
from proctor.ledger import SYSTEM_LOG, Actor, Signer, canonical_json, utc_now
from proctor.store import Engine, open_store, redact, restore_postgres

RESTORED = "restored.json"
_COSIGNED = re.compile(r"last cosigned(?: has size | \(size )(\d+)")
_HOME_DB = "proctor.db"


@dataclass(frozen=True)
class RestoreReport:
    home: Path
    backup: BackupReport
    store: str

    def as_json(self) -> dict[str, Any]:
        return {
            "home": str(self.home),
            "store": self.store,
            "created": self.backup.manifest.created,
            "logs": {log: {"size": size} for log, size in sorted(self.backup.logs.items())},
            "files": self.backup.files,
            "skipped": self.backup.manifest.skipped,
        }


def restore_backup(
    directory: Path, home: Path, *, key: str | None = None, store: str | None = None
) -> RestoreReport:
    """Make a working home at ``home`` (new, or an empty directory) from the backup."""
    if home.exists() and (not home.is_dir() or any(home.iterdir())):
        raise UsageError(f"{home} exists and is not empty: a restore makes a new home",
                         hint="give a new directory to --home")  # fmt: skip
    try:
        home.absolute().resolve().relative_to(directory.absolute().resolve())
    except ValueError:
        pass
    else:
        raise UsageError(f"{home} lies inside the backup {directory}",
                         hint="give a new directory outside it to --home")  # fmt: skip
    if store is not None and not store.startswith(("postgresql://", "postgres://")):
        raise UsageError(f"--store must be a postgresql:// URL, not {redact(store)!r}")
    report = verify_backup(directory, key)
    m = report.manifest
    if not m.keys:
        raise UsageError(
            "this backup was made without the home's keys (--no-keys): it can be verified, "
            "not restored",
            hint="restore from a backup made with its keys",
        )
    if m.engine is Engine.POSTGRESQL and store is None:
        raise UsageError(
            "the backup is of a PostgreSQL store: it restores into a new, empty database",
            hint="create one and give it with --store postgresql://…",
        )
    if m.engine is Engine.SQLITE and store is not None:
        raise UsageError("the backup is of a SQLite store: it restores into the new home's "
                         "own file; leave out --store")  # fmt: skip
    made = not home.exists()
    make_dir(home)
    os.chmod(home, 0o700)
    try:
        url = _restore(directory, home, m, store)
    except BaseException:
        _undo(home, made)
        raise
    return RestoreReport(home, report, redact(url) if store else f"sqlite:///{_HOME_DB}")


def _undo(home: Path, made: bool) -> None:
    if made:
        shutil.rmtree(home, ignore_errors=True)
        return
    for entry in home.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _restore(directory: Path, home: Path, m: Manifest, store: str | None) -> str:
    prefix = f"{HOME}/"
    for rel, want in sorted(m.files.items()):
        if not rel.startswith(prefix) or rel == f"{HOME}/config.json":
            continue
        got = copy_hashed(directory / rel, home / rel.removeprefix(prefix))
        if got != want:
            raise VerificationFailed(f"{rel} changed while it was restored")
    if store is None:
        got = copy_hashed(directory / m.store, home / _HOME_DB)
        if got != m.files[m.store]:
            raise VerificationFailed(f"{m.store} changed while it was restored")
        url = f"sqlite:///{_HOME_DB}"
        opened_url = f"sqlite:///{home.absolute() / _HOME_DB}"
    else:
        restore_postgres(directory / m.store, store)
        url = opened_url = store
    raw = json.loads((directory / HOME / "config.json").read_bytes())
    if not isinstance(raw, dict):
        raise VerificationFailed("the backup's config.json is not an object")
    key_rel = str(raw.get("key", "keys/ledger.pem"))
    if Path(key_rel).is_absolute():
        key_rel = "keys/ledger.pem"
    raw.update(store=url, key=key_rel, trust_domain=m.trust_domain)
    _check_restored(home, m, opened_url, key_rel)
    _write_private(home / RESTORED, canonical_json(_record(directory, m)) + b"\n")
    # Last, as `proctor init` does: its presence makes the directory a home.
    _write_private(home / "config.json",
                   json.dumps(raw, indent=2, sort_keys=True).encode() + b"\n")  # fmt: skip
    return url


def _check_restored(home: Path, m: Manifest, url: str, key_rel: str) -> None:
    """The new home's store, through its own runtime: each log at the backup's
    checkpoint and verified, every tenant's rows backed by its log."""
    from proctor.governance import unbacked_rows
    from proctor.runtime import Config, Runtime

    config = Config(m.trust_domain, url, key_rel, "restore")
    signer = Signer.load(m.trust_domain, home / key_rel)
    opened = open_store(url)
    # Not Runtime.open: nothing (the sweep of runs whose owner died) runs before the
    # home is whole and verified.
    rt = Runtime(home, config, opened, signer)
    try:
        for log, point in sorted(m.logs.items()):
            head = rt.ledger.head(log)
            if (head.size, head.root) != (point.size, point.root):
                raise VerificationFailed(
                    f"log {log!r} of the restored store has size {head.size}, the backup's "
                    f"checkpoint {point.size}"
                )
            rt.ledger.verify(log)
            if log != SYSTEM_LOG:
                problems, _ = unbacked_rows(rt.store, rt.ledger, rt.artifacts, rt.approvals,
                                            rt.deployments, log)  # fmt: skip
                if problems:
                    raise VerificationFailed(
                        f"{len(problems)} store row(s) of {log!r} in the restored store are "
                        f"not backed by its log: {problems[0].kind} {problems[0].key}"
                    )
        # Verified as the backup left it; now the runs it caught running are over
        # here (their sandboxes are the original home's, left alone).
        rt.close_restored_runs(Actor("runtime", "restore"))
    finally:
        rt.close()


def _record(directory: Path, m: Manifest) -> dict[str, Any]:
    return {
        "format": "proctor-restore/1",
        "backup": str(directory.absolute()),
        "backup_created": m.created,
        "restored_at": utc_now(),
        "logs": {
            log: {"size": p.size, "root": base64.b64encode(p.root).decode()}
            for log, p in sorted(m.logs.items())
        },
    }


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class Restored:
    """Where a restored home's log stood when it was restored."""

    backup_created: str
    restored_at: str
    size: int


def restored_from(home: Path, log: str) -> Restored | None:
    """The restore record of ``log`` in ``home``, or None for a home not restored."""
    try:
        raw = json.loads((home / RESTORED).read_bytes())
        point = raw["logs"][log]
        return Restored(str(raw["backup_created"]), str(raw["restored_at"]), int(point["size"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def behind_witnesses(home: Path, log: str, error: VerificationFailed) -> None:
    """Add to a witness check's failure on a restored home how far its log is behind:
    the witnesses cosigned a larger tree of the original's log than the backup held."""
    restored = restored_from(home, log)
    if restored is None:
        return
    # The witness check's sentences (witness.require_extends) name the size cosigned.
    sizes = [int(s) for s in _COSIGNED.findall(error.message)]
    cosigned = max(sizes, default=0)
    if cosigned <= restored.size:
        return
    error.message += (
        f"; this home was restored from a backup taken {restored.backup_created} that holds "
        f"{restored.size} events of the log: the restored log is {cosigned - restored.size} "
        f"entries behind the newest cosigned checkpoint (size {cosigned}), and those entries "
        "are not in it"
    )
