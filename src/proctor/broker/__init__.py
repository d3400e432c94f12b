"""The broker: the only way out of a sandbox.

Every call (HTTP(S) through the egress proxy, SQL on a dataset, a file in a
bucket, a secret used on the code's behalf) is authenticated as the run's
workload, decided by Cedar, recorded in the ledger before it is answered, and
refused if the ledger cannot record it; so is every answer the socket gives
itself (whoami, malformed requests, unknown endpoints, refused tokens).
"""

from proctor.broker._ask import AskGate, AskRules
from proctor.broker._connectors import (
    dataset_connector,
    describe_dataset,
    handle_sql,
    locate_dataset,
    missing_in_dataset,
    revoke_run_grants,
)
from proctor.broker._datasets import ColumnShape, DatasetConnector, StatementTimeout, TableShape
from proctor.broker._egress import SPECIAL_ADDRESS_RULE, EgressDenied, UpstreamFailed
from proctor.broker._exposure import exposed_in_dataset
from proctor.broker._factory import broker_socket_root, make_broker, reap_broker_sockets
from proctor.broker._files import (
    ObjectNotFound,
    ObjectTooLarge,
    read_object,
    write_object,
)
from proctor.broker._mitm import CAError, TenantCA
from proctor.broker._proxy import SECRET_BINDING_RULE, EgressProxy, system_resolver
from proctor.broker._rules import approved_rules, rule_hosts
from proctor.broker._scope import (
    RATE_LIMIT_RULE,
    WHOAMI_RULE,
    BadCall,
    BrokerError,
    CallDenied,
    CallRefused,
    DatasetBinding,
    RateLimit,
    RateLimited,
    RunScope,
    SecretBinding,
)
from proctor.broker._server import Broker, Handlers, RunChannel
from proctor.governance import MAX_OBJECT_BYTES

__all__ = [
    "MAX_OBJECT_BYTES",
    "RATE_LIMIT_RULE",
    "SECRET_BINDING_RULE",
    "SPECIAL_ADDRESS_RULE",
    "WHOAMI_RULE",
    "AskGate",
    "AskRules",
    "BadCall",
    "Broker",
    "BrokerError",
    "CAError",
    "CallDenied",
    "CallRefused",
    "ColumnShape",
    "DatasetBinding",
    "DatasetConnector",
    "EgressDenied",
    "EgressProxy",
    "Handlers",
    "ObjectNotFound",
    "ObjectTooLarge",
    "RateLimit",
    "RateLimited",
    "RunChannel",
    "RunScope",
    "SecretBinding",
    "StatementTimeout",
    "TableShape",
    "TenantCA",
    "UpstreamFailed",
    "approved_rules",
    "broker_socket_root",
    "dataset_connector",
    "describe_dataset",
    "exposed_in_dataset",
    "handle_sql",
    "locate_dataset",
    "make_broker",
    "missing_in_dataset",
    "read_object",
    "reap_broker_sockets",
    "revoke_run_grants",
    "rule_hosts",
    "system_resolver",
    "write_object",
]
