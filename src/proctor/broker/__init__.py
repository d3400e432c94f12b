"""The broker: the only way out of a sandbox.

Every call (HTTP(S) through the egress proxy, SQL on a dataset, a file in a
bucket, a secret used on the code's behalf) is authenticated as the run's
workload, decided by Cedar, recorded in the ledger before it is answered, and
refused if the ledger cannot record it.
"""

from proctor.broker._scope import (
    BadCall,
    BrokerError,
    CallDenied,
    CallRefused,
    DatasetBinding,
    RunScope,
    SecretBinding,
)
from proctor.broker._server import Broker, Handlers, RunChannel

__all__ = [
    "BadCall",
    "Broker",
    "BrokerError",
    "CallDenied",
    "CallRefused",
    "DatasetBinding",
    "Handlers",
    "RunChannel",
    "RunScope",
    "SecretBinding",
]
