"""The API server in a child process with a small descriptor limit, for the
connection tests (tests/security/test_api_connections.py). Not a test module.

    python -m tests.security.api_child HOME SOFT HARD LIMITS_JSON [--tls CERT KEY]

Sets RLIMIT_NOFILE to (SOFT, HARD) before anything opens, builds a home with two
tenants (acme, globex) and one auditor each, starts ``serve_api`` on a loopback
port, and prints one JSON line: the url, the tokens, the descriptor limit before
and after the server started, and the gate's bounds. It serves until its stdin
closes, then stops the server and prints the ``api.connections.refused`` events of
the system log as a second JSON line."""

from __future__ import annotations

import dataclasses
import json
import resource
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    home, soft, hard, limits_json = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    before = resource.getrlimit(resource.RLIMIT_NOFILE)

    from proctor.api import Limits, serve_api
    from proctor.runtime import Runtime, init_home

    tls: dict[str, Path] = {}
    if len(argv) > 4 and argv[4] == "--tls":
        tls = {"certfile": Path(argv[5]), "keyfile": Path(argv[6])}
    init_home(home)
    rt = Runtime.open(home)
    tokens = {}
    for tenant in ("acme", "globex"):
        rt.tenants.create(tenant, rt.operator)
        _, tokens[tenant] = rt.principals.create(tenant, "aud", "user", ["auditor"], rt.operator)
    server = serve_api(rt, "127.0.0.1", 0, limits=Limits(**json.loads(limits_json)), **tls)
    gate = server.gate
    assert gate is not None
    after = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(
        json.dumps(
            {
                "url": server.url,
                "host": server.host,
                "port": server.port,
                "tokens": tokens,
                "before": before,
                "after": after,
                "bounds": dataclasses.asdict(gate.bounds),
            }
        ),
        flush=True,
    )
    sys.stdin.read()
    server.stop()
    events = [json.loads(e) for e in rt.ledger.entries("system")]
    refused = [e for e in events if e["action"] == "api.connections.refused"]
    print(json.dumps(refused), flush=True)
    rt.close()


if __name__ == "__main__":
    main(sys.argv[1:])
