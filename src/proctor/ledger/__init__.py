"""The tamper-evident audit ledger.

One append-only RFC 6962 Merkle log per tenant (and one ``system`` log for the
runtime), stored as C2SP tlog-tiles, with C2SP signed checkpoints, RFC 9162
inclusion and consistency proofs, group-committed durable appends, and offline
verification from an export and the verifier key alone.
"""

from proctor.ledger._actions import Action
from proctor.ledger._canonical import canonical_json, parse_canonical
from proctor.ledger._erasures import (
    ERASURE_LIST_FORMAT,
    ErasureCheck,
    ErasureRecord,
    erasure_list,
    erasure_record,
)
from proctor.ledger._event import (
    CUT_MARKER,
    MAX_EVENT_BYTES,
    Actor,
    Decision,
    EventDraft,
    bound_details,
    clip,
    utc_now,
)
from proctor.ledger._ledger import (
    SYSTEM_LOG,
    Appended,
    ConsistencyProof,
    InclusionProof,
    Ledger,
    LogHead,
    TxHook,
    verify_export,
)
from proctor.ledger._merkle import (
    leaf_hash,
    node_hash,
    path_from_ranges,
    root_from_inclusion,
    verify_consistency,
    verify_inclusion,
)
from proctor.ledger._note import (
    Checkpoint,
    CosignatureVerifier,
    Cosigner,
    Signer,
    Verifier,
    add_signatures,
    cosigned_by,
    cosigned_message,
    open_checkpoint,
    parse_checkpoint,
    require_cosignatures,
    split_note,
)
from proctor.ledger._objects import (
    ERASED_FORMAT,
    LINEAGE_FORMAT,
    LedgerObject,
    check_erased_object,
    check_lineage_object,
    erase_entry,
    erase_from_object,
    erased_entries,
    is_erased_object,
    kept_keys,
    keyed_hash,
    lineage_keys,
    lineage_leaf,
    lineage_object,
    lineage_proof,
    lineage_salt,
    lineage_seqs,
    objects_in,
    read_objects,
)
from proctor.ledger._prune import MAX_PER_EVENT as MAX_PRUNED_PER_EVENT
from proctor.ledger._prune import MAX_RANGES as MAX_PRUNE_RANGES
from proctor.ledger._prune import PRUNE_ACTION, PRUNED_ACTION, PrunePlan, prune_draft
from proctor.ledger._prune import is_marker as is_pruned_marker
from proctor.ledger._prune import marker_leaf as pruned_leaf_hash
from proctor.ledger._query import DECISIONS, EventFilter, iter_events, query_events
from proctor.ledger._receipt import Receipt, make_receipt, verify_receipt
from proctor.ledger._tiles import TileRef, parse_tile_path, tile_path
from proctor.ledger._verify import VerifyReport, verify_log

__all__ = [
    "CUT_MARKER",
    "DECISIONS",
    "ERASED_FORMAT",
    "ERASURE_LIST_FORMAT",
    "LINEAGE_FORMAT",
    "MAX_EVENT_BYTES",
    "MAX_PRUNED_PER_EVENT",
    "MAX_PRUNE_RANGES",
    "PRUNED_ACTION",
    "PRUNE_ACTION",
    "SYSTEM_LOG",
    "Action",
    "Actor",
    "Appended",
    "Checkpoint",
    "ConsistencyProof",
    "CosignatureVerifier",
    "Cosigner",
    "Decision",
    "ErasureCheck",
    "ErasureRecord",
    "EventDraft",
    "EventFilter",
    "InclusionProof",
    "Ledger",
    "LedgerObject",
    "LogHead",
    "PrunePlan",
    "Receipt",
    "Signer",
    "TileRef",
    "TxHook",
    "Verifier",
    "VerifyReport",
    "add_signatures",
    "bound_details",
    "canonical_json",
    "check_erased_object",
    "check_lineage_object",
    "clip",
    "cosigned_by",
    "cosigned_message",
    "erase_entry",
    "erase_from_object",
    "erased_entries",
    "erasure_list",
    "erasure_record",
    "is_erased_object",
    "is_pruned_marker",
    "iter_events",
    "kept_keys",
    "keyed_hash",
    "leaf_hash",
    "lineage_keys",
    "lineage_leaf",
    "lineage_object",
    "lineage_proof",
    "lineage_salt",
    "lineage_seqs",
    "make_receipt",
    "node_hash",
    "objects_in",
    "open_checkpoint",
    "parse_canonical",
    "parse_checkpoint",
    "parse_tile_path",
    "path_from_ranges",
    "prune_draft",
    "pruned_leaf_hash",
    "query_events",
    "read_objects",
    "require_cosignatures",
    "root_from_inclusion",
    "split_note",
    "tile_path",
    "utc_now",
    "verify_consistency",
    "verify_export",
    "verify_inclusion",
    "verify_log",
    "verify_receipt",
]
