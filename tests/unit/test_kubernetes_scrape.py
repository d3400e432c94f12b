"""deploy/prometheus/prometheus.yml against deploy/kubernetes: the scrape finds
the node pods (the headless Service's DNS name in the kustomization's namespace,
not-ready pods included), on the container's API port with the API's scheme,
shows the token serve reads (the same Secret, mounted), and names the API
certificate's Service; readiness asks /readyz and the other probes /healthz, all
paths the API serves without a credential; every Secret the manifests mount is
one docs/deploy.md says how to create. (serve with the manifest's command line
answers the scrape: tests/unit/test_kubernetes_manifests.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import yaml

from proctor.api import openapi_document
from proctor.lifecycle import CHECKS

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"


def _resources() -> list[dict[str, Any]]:
    out = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def _kind(kind: str) -> list[dict[str, Any]]:
    return [r for r in _resources() if r["kind"] == kind]


def _container() -> tuple[dict[str, Any], dict[str, Any]]:
    (deployment,) = _kind("Deployment")
    pod = deployment["spec"]["template"]
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "proctor"]
    return pod, container


def _flags(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.partition("=")[::2] for arg in container["args"])


def _job() -> dict[str, Any]:
    (job,) = yaml.safe_load(CONFIG.read_text())["scrape_configs"]
    job_: dict[str, Any] = job
    return job_


def test_the_scrape_finds_every_node_pod_through_the_headless_service() -> None:
    (namespace,) = [r["namespace"] for r in _resources() if r["kind"] == "Kustomization"]
    (headless,) = [s for s in _kind("Service") if s["spec"].get("clusterIP") == "None"]
    assert headless["spec"]["publishNotReadyAddresses"] is True  # a node not ready is scraped
    pod, container = _container()
    assert headless["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (sd,) = _job()["dns_sd_configs"]
    name = headless["metadata"]["name"]
    assert sd["names"] == [f"{name}.{namespace}.svc.cluster.local"] and sd["type"] == "A"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (port,) = headless["spec"]["ports"]
    assert sd["port"] == ports[port["targetPort"]] == int(_flags(container)["--api-port"])


def test_the_scrape_speaks_the_apis_scheme_and_shows_the_token_serve_reads() -> None:
    pod, container = _container()
    flags = _flags(container)
    job = _job()
    assert job["scheme"] == ("https" if "--tls-cert" in flags else "http")
    assert job["metrics_path"] == "/metrics" and "/metrics" in openapi_document()["paths"]
    # serve's token file lies in the proctor-metrics Secret; Prometheus mounts the same.
    token = flags["--metrics-token-file"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    directory, _, file = token.rpartition("/")
    mount = mounts[directory]
    assert mount["readOnly"] is True
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == "proctor-metrics" and secret["defaultMode"] == 0o400
    assert {i["path"]: i["key"] for i in secret["items"]}[file] == "token"
    assert job["authorization"]["credentials_file"].endswith("/token")
    # The certificate names the API's Service, not a pod's IP.
    (namespace,) = [r["namespace"] for r in _resources() if r["kind"] == "Kustomization"]
    api = [s for s in _kind("Service") if s["spec"].get("clusterIP") != "None"]
    assert job["tls_config"]["server_name"] in {
        f"{s['metadata']['name']}.{namespace}.svc" for s in api
    }


def test_readiness_asks_readyz_and_the_other_probes_healthz() -> None:
    _, container = _container()
    paths = openapi_document()["paths"]
    wanted = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in wanted.items():
        asked, _, query = container[probe]["httpGet"]["path"].partition("?")
        assert asked == path, probe
        operation = paths[path]["get"]
        assert operation.get("security") in (None, []), f"{path} needs a credential"
        given = {name for name, _ in parse_qsl(query)}
        assert given <= {p["name"] for p in operation.get("parameters", [])}, probe
    # Not ready is an answer of its own (503 with the reasons), not an error page.
    assert "503" in paths["/readyz"]["get"]["responses"]


def test_readiness_leaves_out_only_what_every_node_shares() -> None:
    """The witnesses (one stale witness would take every node out of the Service; the
    alert ProctorWitnessStale watches them); every other check stays."""
    _, container = _container()
    query = container["readinessProbe"]["httpGet"]["path"].partition("?")[2]
    excluded = [value for name, value in parse_qsl(query) if name == "exclude"]
    assert excluded == ["witnesses"]
    assert set(excluded) < set(CHECKS)  # a check's name, not a typo (answered 400)
    rules = (ROOT / "deploy" / "prometheus" / "proctor.rules.yml").read_text()
    assert "proctor_witness_checkpoint_age_seconds" in rules


def test_every_secret_the_manifests_mount_is_created_in_the_docs() -> None:
    pod, _ = _container()
    mounted = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
    created = set(re.findall(r"kubectl -n \S+ create secret \w+ ([\w-]+)", DEPLOY_DOC.read_text()))
    assert "proctor-metrics" in mounted
    assert mounted <= created, f"docs/deploy.md does not create {sorted(mounted - created)}"
