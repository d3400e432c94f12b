"""Backups of a home that restore: ``proctor backup``, ``backup verify``, ``restore``.

A backup is a directory: the store copied consistently while runs write (by its
engine: ``store.copy_sqlite``, ``store.dump_postgres``), each log's newest signed
checkpoint as the copy holds it, the home's files (configuration, keys, blobs,
buckets, run outputs), and a manifest of every file's SHA-256 signed by the home's
checkpoint key. It is checked offline with nothing but itself and the verifier key
(:func:`verify_backup`), and restored into a new home whose paths are its own
(:func:`restore_backup`). It is as sensitive as the home: it holds its private keys.
"""

from proctor.backup._check import BackupReport, verify_backup
from proctor.backup._manifest import FORMAT, LogPoint, Manifest
from proctor.backup._restore import (
    RESTORED,
    Restored,
    RestoreReport,
    behind_witnesses,
    restore_backup,
    restored_from,
)
from proctor.backup._take import take_backup

__all__ = [
    "FORMAT",
    "RESTORED",
    "BackupReport",
    "LogPoint",
    "Manifest",
    "RestoreReport",
    "Restored",
    "behind_witnesses",
    "restore_backup",
    "restored_from",
    "take_backup",
    "verify_backup",
]
