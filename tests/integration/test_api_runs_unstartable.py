"""A run asked of an API whose host cannot start the sandbox it names: a deployment that
is not there is "not found" all the same, the refusal is one clear error, and the API
closes without a broker half made (it crashed on close before)."""

from __future__ import annotations

from pathlib import Path

import httpx

from proctor.api import serve_api
from tests.integration.test_api_support import artifact_dir, build_env


def test_a_run_on_a_host_without_its_backend_is_refused_clearly(tmp_path: Path) -> None:
    env = build_env(tmp_path)
    env.server.stop()
    env.server = serve_api(env.rt, "127.0.0.1", 0, backend="no-such-backend")
    url = f"http://127.0.0.1:{env.server.port}"
    token = env.tokens[("acme", "dev")]
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as http:
            missing = http.post("/tenants/acme/deployments/nope/runs", timeout=30)
            assert missing.status_code == 404, missing.text
            assert "nope" in missing.json()["error"]["message"]
            digest = env.rt.artifacts.submit(
                "acme", artifact_dir(tmp_path, "job"), env.rt.operator
            ).digest
            env.rt.deployments.deploy("acme", env.rt.artifacts.get("acme", digest), "job",
                                      environment="sandbox", instruction="t",
                                      actor=env.rt.operator)  # fmt: skip
            for _ in range(2):  # the second asks afresh: nothing was left half made
                refused = http.post("/tenants/acme/deployments/job/runs", timeout=30)
                assert refused.status_code in (400, 503), refused.text
                assert "no-such-backend" in refused.json()["error"]["message"]
    finally:
        env.server.stop()  # closes the API's state: no broker, no supervisor to stop
        env.rt.close()
