"""What a dataset's database gives every role, whatever a run's grants say.

A grant to PUBLIC is a grant to every run's login: the database would not refuse
what Cedar forbids there. Registering such a dataset needs the operator's
acknowledgement (``proctor dataset add --accept-public-grants REASON``).
"""

from __future__ import annotations

from collections.abc import Callable

from proctor.errors import UsageError
from proctor.governance import DatasetKind


def _postgresql(location: str) -> list[str]:
    import psycopg  # loaded only for a PostgreSQL dataset, as its connector is

    from proctor.broker._pg_sql import public_objects

    try:
        with psycopg.connect(location, connect_timeout=10) as conn:
            return public_objects(conn)
    except psycopg.Error as exc:
        # The DSN may hold a password: never echo it.
        raise UsageError(f"the PostgreSQL dataset cannot be reached: {type(exc).__name__}") from exc


#: By dataset kind, as the connectors are (``_connectors.py``). A SQLite file has no
#: roles: the broker's authorizer is its only boundary, so nothing is exposed there.
_EXPOSURE: dict[DatasetKind, Callable[[str], list[str]]] = {DatasetKind.POSTGRESQL: _postgresql}


def exposed_in_dataset(kind: DatasetKind, location: str) -> list[str]:
    """The objects of the dataset at ``location`` that every role may read or run
    (at most 21, as sentences)."""
    find = _EXPOSURE.get(kind)
    return [] if find is None else find(location)
