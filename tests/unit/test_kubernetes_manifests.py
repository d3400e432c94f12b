"""deploy/kubernetes: every manifest against the Kubernetes API's own schemas, in
strict mode (an unknown field is refused), for each version docs/deploy.md
names; and the properties that matter held to the code they describe: the
probes ask a path the API serves, the container runs ``proctor serve`` with
flags it accepts, nothing is privileged without the reason written down, no
service-account token, the store URL and keys only from Secrets, laid out as
``proctor init`` lays out a home. The last test starts ``proctor serve`` with
the manifest's own command line against a real PostgreSQL and asks its probe."""

from __future__ import annotations

import copy
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from proctor.api import openapi_document
from proctor.runtime import init_home
from tests.conftest import PROCTOR
from tests.integration.test_api_support import self_signed

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
DOCS = ROOT / "docs" / "deploy.md"
#: The three newest minor versions kubernetes-validate ships schemas for; docs/deploy.md
#: names the same (test_the_docs_name_the_validated_versions).
VERSIONS = ("1.35", "1.36", "1.37")
WHY_PRIVILEGED = "proctor.local/privileged-why"
HOME_SECRET = "proctor-home"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def _resources() -> list[dict[str, Any]]:
    return [doc for _, doc in _documents() if doc["kind"] != "Kustomization"]


def _kustomization() -> dict[str, Any]:
    return next(doc for _, doc in _documents() if doc["kind"] == "Kustomization")


def _one(kind: str) -> dict[str, Any]:
    found = [r for r in _resources() if r["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _service(name: str) -> dict[str, Any]:
    (found,) = [r for r in _resources() if r["kind"] == "Service" and r["metadata"]["name"] == name]
    return found


def _workloads() -> list[dict[str, Any]]:
    kinds = ("Deployment", "DaemonSet", "StatefulSet", "Job", "CronJob")
    return [r for r in _resources() if r["kind"] in kinds]


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def _node() -> tuple[dict[str, Any], dict[str, Any]]:
    """The Deployment's pod spec and its proctor container."""
    pod = _pod_spec(_one("Deployment"))
    (container,) = [c for c in pod["containers"] if c["name"] == "proctor"]
    return pod, container


def _flags(container: dict[str, Any]) -> dict[str, str]:
    flags = {}
    for arg in container["args"]:
        name, sep, value = arg.partition("=")
        assert name.startswith("--") and sep, f"write flags as --name=value: {arg!r}"
        flags[name] = value
    return flags


def _mounts(
    pod: dict[str, Any], container: dict[str, Any]
) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (the volume mount, the volume)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container["volumeMounts"]}


def _covering(path: str, mounts: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> str:
    """The mountPath a file path lies under (the deepest)."""
    under = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    assert under, f"{path} lies under no volume mount"
    return max(under, key=len)


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)


# -- the schemas ---------------------------------------------------------------------


def test_the_kustomization_lists_every_manifest_and_only_those() -> None:
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(_kustomization()["resources"]) == on_disk


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_for_the_kubernetes_api_in_strict_mode(version: str) -> None:
    for name, doc in _documents():
        if doc["kind"] == "Kustomization":
            continue
        checked = kubernetes_validate.validate(doc, version, strict=True)
        # The package falls back to an older version's schemas for a newer one it
        # lacks: that would be a version the docs name and nothing checked.
        assert checked == version, f"{name}: checked against {checked}, not {version}"


def test_what_kustomize_builds_is_valid_and_names_the_image_to_set() -> None:
    """What ``kubectl apply -k`` applies: the files with the namespace and the image set."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: the files themselves are checked above")
    built = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True,
                           timeout=60, check=True).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(built) if d]
    assert len(docs) == len(_resources())
    (image,) = _kustomization()["images"]
    for doc in docs:
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == _kustomization()["namespace"]
        if doc["kind"] == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            assert container["image"] == f"{image['newName']}:{image['newTag']}"


def _misspelled(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    container = doc["spec"]["template"]["spec"]["containers"][0]
    bad = copy.deepcopy(doc)
    c = bad["spec"]["template"]["spec"]["containers"][0]
    c["readinessProbes"] = c.pop("readinessProbe")
    yield "readinessProbes", bad
    bad = copy.deepcopy(doc)
    c = bad["spec"]["template"]["spec"]["containers"][0]
    c["securityContext"]["privilged"] = c["securityContext"].pop("privileged")
    yield "privilged", bad
    bad = copy.deepcopy(doc)
    bad["spec"]["template"]["spec"]["automountServiceAccountTokens"] = False
    yield "automountServiceAccountTokens", bad
    bad = copy.deepcopy(doc)
    bad["spec"]["replicas"] = "three"
    yield "replicas", bad
    assert container["name"] == "proctor"  # the original is untouched


@pytest.mark.parametrize("version", VERSIONS)
def test_a_misspelled_field_or_a_wrong_type_is_refused(version: str) -> None:
    deployment = _one("Deployment")
    kubernetes_validate.validate(deployment, version, strict=True)
    for what, bad in _misspelled(deployment):
        with pytest.raises(kubernetes_validate.ValidationError) as caught:
            kubernetes_validate.validate(bad, version, strict=True)
        assert what in str(caught.value.message) or what in [str(p) for p in caught.value.path]


def test_the_docs_name_the_validated_versions() -> None:
    text = DOCS.read_text()
    for version in VERSIONS:
        assert re.search(rf"\b{re.escape(version)}\b", text), f"docs/deploy.md omits {version}"


# -- what the node runs --------------------------------------------------------------


def test_the_container_runs_proctor_serve_from_the_kustomized_image() -> None:
    _, container = _node()
    assert container["command"] == ["proctor", "serve"]
    images = {i["name"] for i in _kustomization().get("images", [])}
    assert container["image"] in images  # the operator points it at their registry
    flags = _flags(container)
    assert flags["--backend"] == "gvisor"  # never a silent fall back to bubblewrap
    assert "--no-api" not in flags


def test_the_probes_ask_a_path_the_api_serves_on_the_api_port_with_its_scheme() -> None:
    _, container = _node()
    paths = openapi_document()["paths"]
    flags = _flags(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    scheme = "HTTPS" if "--tls-cert" in flags else "HTTP"
    probes = [container.get(k) for k in ("startupProbe", "livenessProbe", "readinessProbe")]
    assert all(probes), "startup, liveness and readiness probes"
    for probe in probes:
        get = probe["httpGet"]
        path = get["path"].partition("?")[0]  # a query string is the check's own
        assert "get" in paths.get(path, {}), f"the API serves no GET {get['path']}"
        port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        assert port == int(flags["--api-port"])
        assert get.get("scheme", "HTTP") == scheme
    # The one path that needs no credential: a probe carries none.
    security = paths[probes[0]["httpGet"]["path"]]["get"].get("security")
    assert security in (None, [])
    for service in [r for r in _resources() if r["kind"] == "Service"]:
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ["api"]


def test_the_service_and_the_budget_select_the_nodes_pods() -> None:
    deployment = _one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in [r for r in _resources() if r["kind"] == "Service"]:
        assert service["spec"]["selector"].items() <= labels.items()
    # Clients reach ready nodes only; Prometheus every node (tests/unit/test_kubernetes_scrape.py).
    assert not _service("proctor-api")["spec"].get("publishNotReadyAddresses")
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    # One node per machine: required anti-affinity on the hostname, and no surge.
    (term,) = _pod_spec(deployment)["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


# -- privileges ----------------------------------------------------------------------


def _anchors(markdown: str) -> set[str]:
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^a-z0-9 -]", "", title).replace(" ", "-"))
    return out


def test_nothing_is_privileged_without_its_reason_in_the_docs() -> None:
    anchors = _anchors(DOCS.read_text())
    privileged = []
    for workload in _workloads():
        template = workload["spec"]["template"]
        pod = template["spec"]
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert pod.get(flag, False) is False, f"{workload['metadata']['name']}: {flag}"
        assert not [v for v in pod.get("volumes", []) if "hostPath" in v], "no hostPath volume"
        for c in pod["containers"] + pod.get("initContainers", []):
            ctx = c.get("securityContext", {})
            if ctx.get("privileged"):
                privileged.append(c["name"])
                why = template["metadata"].get("annotations", {}).get(WHY_PRIVILEGED, "")
                page, _, anchor = why.partition("#")
                assert page == "docs/deploy.md" and anchor in anchors, (
                    f"{c['name']} is privileged: {WHY_PRIVILEGED} must name the docs' section"
                )
            else:
                assert ctx.get("allowPrivilegeEscalation") is False, c["name"]
    # The runtime alone: it starts runsc and bwrap and writes the run's cgroups.
    assert privileged == ["proctor"]


def test_the_privileged_container_is_otherwise_held_in() -> None:
    pod, container = _node()
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True
    assert pod["enableServiceLinks"] is False
    # Only on machines set aside for it (a taint keeps the rest of the cluster off).
    assert pod["nodeSelector"] == {"proctor.local/sandbox-host": "true"}
    assert [t["key"] for t in pod["tolerations"]] == ["proctor.local/sandbox-host"]
    # A namespace that admits it says so.
    labels = _one("Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def test_no_service_account_token_is_mounted() -> None:
    accounts = {r["metadata"]["name"]: r for r in _resources() if r["kind"] == "ServiceAccount"}
    assert accounts and all(a["automountServiceAccountToken"] is False for a in accounts.values())
    for workload in _workloads():
        pod = _pod_spec(workload)
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] in accounts  # never the namespace's default
    assert not [r for r in _resources() if r["kind"] in ("Role", "ClusterRole", "RoleBinding",
                                                          "ClusterRoleBinding")]  # fmt: skip


# -- secrets -------------------------------------------------------------------------

_LITERAL_SECRETS = re.compile(
    r"postgres(ql)?://|password|-----BEGIN|sslpassword|client_secret", re.IGNORECASE
)


def test_no_secret_value_is_written_in_the_manifests() -> None:
    assert not [r for r in _resources() if r["kind"] in ("Secret", "ConfigMap")]
    kustomization = _kustomization()
    assert "secretGenerator" not in kustomization and "configMapGenerator" not in kustomization
    for name, doc in _documents():
        for text in _strings(doc):
            assert not _LITERAL_SECRETS.search(text), f"{name}: {text!r}"
    _, container = _node()
    for env in container.get("env", []):
        assert "valueFrom" in env or not _LITERAL_SECRETS.search(env["value"]), env


def test_the_home_identity_comes_from_one_secret_laid_out_as_init_lays_out_a_home(
    tmp_path: Path,
) -> None:
    pod, container = _node()
    mounts = _mounts(pod, container)
    home = _flags(container)["--home"]
    # What `proctor init` writes that every node must share, found by running it.
    made = tmp_path / "home"
    init_home(made)
    shared = {"config.json", *(f"keys/{p.name}" for p in (made / "keys").iterdir())}
    assert shared == {"config.json", "keys/ledger.pem", "keys/runtime.key"}
    served = set()
    for rel in shared:
        target = f"{home}/{rel}"
        mount, volume = mounts[_covering(target, mounts)]
        assert volume.get("secret", {}).get("secretName") == HOME_SECRET, target
        assert mount.get("readOnly") is True, target
        inside = target.removeprefix(mount["mountPath"]).lstrip("/") or mount.get("subPath")
        items = {i["path"]: i["key"] for i in volume["secret"]["items"]}
        assert inside in items, f"{target} is not an item of the Secret"
        assert volume["secret"]["defaultMode"] == 0o400
        served.add(items[inside])
    assert served == {"config.json", "ledger.pem", "runtime.key"}
    # The store URL is config.json's "store": only in that Secret, never in an env or arg.
    assert '"store"' in (made / "config.json").read_text()


def test_tls_and_oidc_files_come_from_secrets() -> None:
    pod, container = _node()
    mounts = _mounts(pod, container)
    flags = _flags(container)
    for flag in ("--tls-cert", "--tls-key", "--oidc-config"):
        mount, volume = mounts[_covering(flags[flag], mounts)]
        assert "secret" in volume and mount.get("readOnly") is True, flag


# -- the manifest's command line, run ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_manifests_command_line_starts_serve_and_its_probe_answers(
    tmp_path: Path, pg_dsn: str
) -> None:
    """The pod's filesystem is built under ``tmp_path/pod`` from what the manifest
    mounts (the Secrets' files from a home `proctor init` made on PostgreSQL, empty
    directories for the rest); serve gets the container's command, args and env
    with paths moved there, loopback instead of 0.0.0.0 and a free port."""
    pod, container = _node()
    root = tmp_path / "pod"
    made = tmp_path / "made"
    init_home(made, store=pg_dsn)
    certfile, keyfile = self_signed(tmp_path)
    secret_files = {
        HOME_SECRET: {"config.json": made / "config.json",
                      "ledger.pem": made / "keys" / "ledger.pem",
                      "runtime.key": made / "keys" / "runtime.key"},
        "proctor-tls": {"tls.crt": certfile, "tls.key": keyfile},
    }  # fmt: skip
    oidc = tmp_path / "oidc.json"
    oidc.write_text('{"issuers": []}\n')  # no OIDC: docs/deploy.md says to create it so
    secret_files["proctor-oidc"] = {"oidc.json": oidc}
    scrape_token = tmp_path / "metrics-token"
    scrape_token.write_text(secrets.token_hex(32) + "\n")
    secret_files["proctor-metrics"] = {"token": scrape_token}
    for mount, volume in _mounts(pod, container).values():
        where = root / mount["mountPath"].lstrip("/")
        if "secret" in volume:
            files = secret_files[volume["secret"]["secretName"]]
            items = volume["secret"].get("items") or [{"key": k, "path": k} for k in files]
            for item in items:
                if mount.get("subPath") not in (None, item["path"]):
                    continue
                dest = where if mount.get("subPath") else where / item["path"]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(files[item["key"]].read_bytes())
                dest.chmod(volume["secret"]["defaultMode"])
        else:
            where.mkdir(parents=True, exist_ok=True)

    def moved(value: str) -> str:
        return str(root / value.lstrip("/")) if value.startswith("/") else value

    port = _free_port()
    args = []
    for name, value in _flags(container).items():
        value = {"--api-host": "127.0.0.1", "--api-port": str(port)}.get(name, moved(value))
        args.append(f"{name}={value}")
    env = dict(os.environ)
    env.update({e["name"]: moved(e["value"]) for e in container["env"]})
    # The /run mount's defaults, moved with it (never the host's /run).
    env["PROCTOR_SANDBOX_REGISTRY"] = str(root / "run" / "proctor-sandboxes")
    env["PROCTOR_BROKER_SOCKETS"] = str(root / "run" / "proctor-brokers")
    command = [PROCTOR if c == "proctor" else c for c in container["command"][:1]]
    command += container["command"][1:] + args
    # The startup and liveness probe; readiness (/readyz) would start a sandbox.
    probe = container["startupProbe"]["httpGet"]
    url = f"{probe['scheme'].lower()}://127.0.0.1:{port}{probe['path']}"
    trust = ssl.create_default_context(cafile=str(certfile))
    log = tmp_path / "serve.stderr"
    with log.open("wb") as err:
        serve = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        answer = None
        deadline = time.monotonic() + 60  # the startup probe allows five minutes
        while answer is None and time.monotonic() < deadline and serve.poll() is None:
            try:
                answer = httpx.get(url, verify=trust, timeout=5)
            except httpx.TransportError:
                time.sleep(0.2)
        assert answer is not None, f"serve never answered its probe:\n{log.read_text()}"
        assert answer.status_code == 200 and answer.json()["status"] == "ok"
        # Prometheus's scrape (deploy/prometheus/prometheus.yml): the Secret's token.
        metrics = url.replace(probe["path"], "/metrics")
        bearer = {"Authorization": f"Bearer {scrape_token.read_text().strip()}"}
        scraped = httpx.get(metrics, headers=bearer, verify=trust, timeout=10)
        assert scraped.status_code == 200 and "proctor_build_info" in scraped.text
        assert httpx.get(metrics, verify=trust, timeout=10).status_code == 401
        # Plain HTTP is refused: the probe's scheme is the one the API speaks.
        with pytest.raises(httpx.TransportError):
            httpx.get(url.replace("https://", "http://"), timeout=5).raise_for_status()
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=pod["terminationGracePeriodSeconds"])
    assert serve.returncode == 0, log.read_text()
    # Nothing was written into the Secrets' files (they are read-only in the pod).
    assert (root / "var/lib/proctor/config.json").read_bytes() == (
        made / "config.json"
    ).read_bytes()
