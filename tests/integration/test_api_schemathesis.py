"""Schemathesis against the served OpenAPI document: generated requests (bounded
examples per operation) find no 5xx and no response outside the document."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.integration.test_api_support import ApiEnv, artifact_dir, build_env

# The fuzzer acts as an admin, named so that a generated name will not be it (it
# could otherwise rotate its own token or disable itself mid-run).
_FUZZ = "fuzz-admin-7f3a"


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiEnv, str]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    env = build_env(tmp)
    _, token = env.rt.principals.create("acme", _FUZZ, "user", ["admin"], env.rt.operator)
    # Something real to find: an artifact, a deployment, an approval.
    art = env.rt.artifacts.submit("acme", artifact_dir(tmp), env.rt.operator)
    env.rt.deployments.deploy("acme", art, "hello", environment="sandbox", mode="job",
                              instruction="fuzzing", actor=env.rt.operator)  # fmt: skip
    yield env, token
    env.server.stop()
    env.rt.close()


def _tar(members: dict[str, bytes], gz: bool) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


_MANIFEST = b'[artifact]\nname = "f"\nentrypoint = ["python3", "main.py"]\npurpose = "fuzz"\n'
# Random bytes, and archives that are valid, or valid tar with a bad manifest.
for _media, _gz in (("application/x-tar", False), ("application/gzip", True)):
    schemathesis.openapi.media_type(
        _media,
        st.binary(max_size=1024)
        | st.builds(
            lambda body, manifest, gz=_gz: _tar({"proctor.toml": manifest, "main.py": body}, gz),
            st.binary(max_size=64),
            st.sampled_from([_MANIFEST, b"[artifact]\n", b"\xff"]),
        ),
    )

_CHECKS = [
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
    content_type_conformance,
]


def test_api_conforms(fuzz_env: tuple[ApiEnv, str]) -> None:
    """Every operation but the run stream (which starts sandboxes) and the events
    follow (which never ends by itself) fuzzed, positive
    and negative data, a fixed number of examples each; failures collected, not
    stopped at, so one run shows them all."""
    env, token = fuzz_env
    schema = schemathesis.openapi.from_url(f"{env.url}/openapi.json")
    failures: list[str] = []
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path.endswith("/runs") and operation.method.upper() == "POST":
            continue
        if operation.path.endswith("/events/follow"):
            continue  # open until the client leaves (tests/e2e/test_developer_view.py)
        if operation.path == "/readyz":
            continue  # 503 by design when not ready; takes no input (test_readiness.py)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{operation.label} ({mode.value})"

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=15,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.generate],
            )
            def run(case: schemathesis.Case) -> None:
                nonlocal calls
                calls += 1
                try:
                    case.call_and_validate(
                        base_url=env.url,
                        headers={"Authorization": f"Bearer {token}"},
                        checks=_CHECKS,
                    )
                except Exception as exc:
                    failures.append(f"{label}: {exc}"[:2000])  # noqa: B023 - run() runs right here

            try:
                run()
            except Unsatisfiable:
                continue  # nothing to make invalid (an operation without parameters)
    assert calls > 300, f"only {calls} requests were generated"
    assert not failures, "\n\n".join(failures[:10])
