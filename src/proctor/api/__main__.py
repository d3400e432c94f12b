"""``python -m proctor.api openapi``: print the OpenAPI document (as committed in
``openapi.json`` at the repository root)."""

from __future__ import annotations

import json
import sys

from proctor.api import openapi_document


def main(argv: list[str]) -> int:
    if argv != ["openapi"]:
        sys.stderr.write("usage: python -m proctor.api openapi > openapi.json\n")
        return 2
    sys.stdout.write(json.dumps(openapi_document(), indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
