"""Evidence: what an auditor and a controller can check without trusting the operator.

- :func:`export_pack` writes a period's evidence pack (events, OCSF, signed
  checkpoints, proofs, governance records, report); :func:`verify_pack` checks
  one offline with the verifier key alone.
- :func:`make_receipt` / :func:`verify_receipt`: a C2SP tlog-proof for one event.
- :func:`lineage`, :func:`sample_runs`, :func:`dpa_annex`, :func:`ropa`: the
  questions of data-subject requests, audit sampling and GDPR records.
- :func:`to_ocsf`: one ledger event as OCSF; :func:`export_parquet` a period's OCSF
  as Parquet in AWS Security Lake's custom-source layout (:func:`read_rows` reads
  a file back).

Everything else in this package is private. See docs/evidence.md.
"""

from proctor.evidence._ocsf import OCSF_VERSION, to_ocsf
from proctor.evidence._pack import PACK_FORMAT, PackInfo, export_pack
from proctor.evidence._parquet import ParquetFile, export_parquet, read_rows
from proctor.evidence._queries import dpa_annex, key_hmac, lineage, ropa, sample_runs
from proctor.evidence._receipt import Receipt, make_receipt, verify_receipt
from proctor.evidence._tree import RangeTree
from proctor.evidence._verify import PackReport, verify_pack
from proctor.evidence._witnessed import verify_pack_witnesses

__all__ = [
    "OCSF_VERSION",
    "PACK_FORMAT",
    "PackInfo",
    "PackReport",
    "ParquetFile",
    "RangeTree",
    "Receipt",
    "dpa_annex",
    "export_pack",
    "export_parquet",
    "key_hmac",
    "lineage",
    "make_receipt",
    "read_rows",
    "ropa",
    "sample_runs",
    "to_ocsf",
    "verify_pack",
    "verify_pack_witnesses",
    "verify_receipt",
]
