"""Witnesses: independent parties that cosign a log's checkpoints only if each is
consistent with the last one they cosigned (C2SP tlog-witness, tlog-cosignature),
so that not even the operator, who holds the log's signing key, can rewrite a
tenant's history unnoticed.

Two sides, one component, built on the ledger's notes and proofs:

* the witness itself (``Witness``, ``WitnessServer``): its own Ed25519 key and
  durable state, and the ``add-checkpoint`` HTTP endpoint;
* the runtime's side (``TenantWitnesses``, ``Submitter``): the witnesses a tenant
  uses, the cosignatures they returned, and the thread that submits new
  checkpoints beside the calls, never on their path;
* the verifier's side (``check_policy``, ``verify_witnessed_log``): a log held to
  what the witnesses it names say they last cosigned, asked of them directly.
"""

from proctor.witness._limits import client_key
from proctor.witness._policy import check_policy, witnessed
from proctor.witness._server import WitnessServer, parse_listen
from proctor.witness._tenant import (
    DEFAULT_INTERVAL,
    DEFAULT_MAX_AGE,
    Submission,
    Submitter,
    TenantWitness,
    TenantWitnesses,
    WitnessPolicy,
    add_checkpoint_body,
    submit_interval,
    witnessed_receipt,
)
from proctor.witness._verify import (
    WitnessAnswer,
    WitnessReport,
    ask_witnesses,
    checkpoint_path,
    hold_to_answers,
    require_extends,
    require_fresh,
    verify_witnessed_log,
)
from proctor.witness._witness import SIZE_TYPE, Answer, LogState, Witness

__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_MAX_AGE",
    "SIZE_TYPE",
    "Answer",
    "LogState",
    "Submission",
    "Submitter",
    "TenantWitness",
    "TenantWitnesses",
    "Witness",
    "WitnessAnswer",
    "WitnessPolicy",
    "WitnessReport",
    "WitnessServer",
    "add_checkpoint_body",
    "ask_witnesses",
    "check_policy",
    "checkpoint_path",
    "client_key",
    "hold_to_answers",
    "parse_listen",
    "require_extends",
    "require_fresh",
    "submit_interval",
    "verify_witnessed_log",
    "witnessed",
    "witnessed_receipt",
]
