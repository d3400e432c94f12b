"""Helpers for tests and benches: a throwaway PostgreSQL server.

Not part of the runtime: nothing under ``proctor`` imports this package.
"""

from proctor.testing._postgres import PostgresServer, PostgresUnavailable, postgres_bin_dir

__all__ = ["PostgresServer", "PostgresUnavailable", "postgres_bin_dir"]
