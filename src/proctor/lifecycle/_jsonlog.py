"""``proctor serve``'s structured log: one JSON object per line, on stderr.

The ledger is the record of what was decided; this log is for the people who run
the machine (what the server did, when, for which request). Every line is
``{"time", "level", "logger", "event", ...fields}``; lines about one API request
carry its ``request_id`` and ``actor`` (the principal's id), which the ledger's
``api.request`` events carry too, so a line leads to its events. docs/operations.md
lists every event and field.

Only the fields a call site names are written, never a request's headers, body or
query string; free text (a warning, an error) is scrubbed of anything shaped like
a token, a bearer credential or a DSN password before it is written.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, TextIO

#: The API request being served, if any: ``{"request_id", "actor"}``. Set by the API
#: per request; a run started by the request carries it into its thread.
REQUEST: ContextVar[dict[str, str] | None] = ContextVar("proctor_request", default=None)

_SCRUB = (
    (re.compile(r"pt_[A-Za-z0-9_\-]+"), "pt_***"),
    (re.compile(r"(?i)(bearer\s+)\S+"), r"\1***"),
    (re.compile(r"(?i)(postgres(?:ql)?://)[^\s/@]*@"), r"\1***@"),
    (re.compile(r"(?i)(password\s*=\s*)('[^']*'|\S+)"), r"\1***"),
)
_TEXT_MAX = 2000


def scrub(text: str) -> str:
    """``text`` with anything shaped like a credential masked, and cut to a line's worth."""
    for pattern, repl in _SCRUB:
        text = pattern.sub(repl, text)
    return text[:_TEXT_MAX]


class JsonFormatter(logging.Formatter):
    """A record as one JSON line. A record made by :func:`log_event` carries its
    event name and fields; any other (a warning, uvicorn's errors) becomes
    ``{"event": "log", "message": ...}``, scrubbed."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC)
        doc: dict[str, Any] = {
            "time": stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        event = getattr(record, "proctor_event", None)
        if event is not None:
            doc["event"] = event
            doc.update(getattr(record, "proctor_fields", {}))
        else:
            doc["event"] = "log"
            doc["message"] = scrub(record.getMessage())
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                doc["error"] = scrub(f"{type(exc).__name__}: {exc}")
        request = REQUEST.get()
        if request is not None:
            for k, v in request.items():
                doc.setdefault(k, v)
        return json.dumps(doc, sort_keys=True, default=str)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO,
              **fields: Any) -> None:  # fmt: skip
    """Log one structured event (a no-op unless ``proctor serve`` turned the log on)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"proctor_event": event, "proctor_fields": fields})


#: The loggers whose lines ``proctor serve`` writes.
_LOGGERS = ("proctor", "uvicorn")


def log_json(stream: TextIO | None = None) -> None:
    """Write Proctor's (and the API server's) log as JSON lines to ``stream``
    (stderr), from level INFO: what ``proctor serve`` does at start."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
    # uvicorn's access log is replaced by the api.request line, which knows the actor.
    logging.getLogger("uvicorn.access").disabled = True
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
