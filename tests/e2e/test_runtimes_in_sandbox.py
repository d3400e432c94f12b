"""Node and Java as an AI agent would write them, in real sandboxes (both drivers),
with no Proctor-specific code: the run's CA is trusted through the variables the
runtime itself reads (NODE_EXTRA_CA_CERTS; a PKCS12 truststore named in
JAVA_TOOL_OPTIONS), and Node's default chunked upload is taken by the broker.

Each runtime also makes the same HTTPS call with the variable removed, which must
fail certificate verification: the variables do the work, nothing else does."""

from __future__ import annotations

import hashlib
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proctor.lifecycle import Supervisor
from proctor.lifecycle._truststore import java_truststore
from tests.e2e.conftest_gov import Gov, build_gov
from tests.e2e.test_broker_sandbox import SECRET, _Auth
from tests.integration.test_broker_proxy import UpstreamCA
from tests.sandbox_conftest_helpers import BACKENDS

pytestmark = pytest.mark.sandbox

NODE = shutil.which("node")
SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
JAVAC = shutil.which("javac")

#: Node's default: http.request with no Content-Length sends the body chunked,
#: one chunk per write. Straight to the broker's socket, as the docs show.
PUT_JS = r"""
const http = require('http');
const data = Buffer.alloc(300001);
for (let i = 0; i < data.length; i++) data[i] = (i * 7) % 251;
const req = http.request({
  socketPath: process.env.PROCTOR_BROKER, method: 'PUT', path: '/v1/files/reports/node.bin',
  headers: {'Proctor-Token': process.env.PROCTOR_TOKEN},
});
req.on('response', (res) => {
  let body = '';
  res.on('data', (d) => body += d);
  res.on('end', () => console.log(JSON.stringify({
    status: res.statusCode, body, te: req.getHeader('transfer-encoding') || null,
    cl: req.getHeader('content-length') || null, chunked: req.chunkedEncoding })));
});
req.on('error', (e) => console.log(JSON.stringify({error: e.message})));
req.write(data.subarray(0, 1));
req.write(data.subarray(1, 100000));
req.write(data.subarray(100000));
req.end();
"""

#: An HTTPS call through the shim's proxy with Node's default trust: a CONNECT, then
#: tls.connect over the tunnel (Node's https module does not read HTTPS_PROXY).
HTTPS_JS = r"""
const http = require('http'), tls = require('tls');
const proxy = new URL(process.env.HTTPS_PROXY);
const [host, port] = [process.argv[2], process.argv[3]];
let data = '';
const done = (o) => { console.log(JSON.stringify(o)); process.exit(0); };
const req = http.request({host: proxy.hostname, port: proxy.port, method: 'CONNECT',
                          path: `${host}:${port}`});
req.on('connect', (res, socket) => {
  if (res.statusCode !== 200) done({error: 'CONNECT ' + res.statusCode});
  const t = tls.connect({socket, servername: host}, () => {
    t.write(`GET / HTTP/1.1\r\nHost: ${host}:${port}\r\nConnection: close\r\n\r\n`);
  });
  // One response, read to its Content-Length: the tunnel may stay open after it.
  const body = () => data.split('\r\n\r\n').slice(1).join('\r\n\r\n');
  t.on('data', (d) => {
    data += d;
    const m = /content-length: *(\d+)/i.exec(data);
    if (data.includes('\r\n\r\n') && m && body().length >= +m[1]) done({body: body()});
  });
  t.on('end', () => done({body: body()}));
  t.on('error', (e) => done({error: e.code || e.message}));
});
setTimeout(() => done({error: 'timeout', data: data}), 30000);
req.on('error', (e) => done({error: 'proxy: ' + e.message}));
req.end();
"""

#: HttpsURLConnection with the default SSLContext: the JVM's trust settings alone.
MAIN_JAVA = r"""
import java.net.URL;
import javax.net.ssl.HttpsURLConnection;

public class Main {
    public static void main(String[] args) {
        try {
            URL url = new URL("https://localhost:" + args[0] + "/");
            HttpsURLConnection c = (HttpsURLConnection) url.openConnection();
            c.setConnectTimeout(15000);
            c.setReadTimeout(15000);
            System.out.println("BODY " + new String(c.getInputStream().readAllBytes()));
        } catch (Exception e) {
            Throwable root = e;
            while (root.getCause() != null) root = root.getCause();
            System.out.println("ERROR " + e.getClass().getName() + ": " + e.getMessage()
                + " / " + root.getClass().getName() + ": " + root.getMessage());
        }
    }
}
"""

#: The entrypoint: each program once as the run starts it, once with its trust
#: variable removed.
MAIN_PY = r"""
import json, os, subprocess, sys, urllib.parse
PORT = os.environ["UP_PORT"]
res = {}
def run(argv, drop=None):
    env = dict(os.environ)
    if drop:
        env.pop(drop, None)
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90)
    return {"rc": p.returncode, "out": p.stdout.strip(), "err": p.stderr[-800:]}
res["env"] = {k: os.environ.get(k) for k in ("NODE_EXTRA_CA_CERTS", "JAVA_TOOL_OPTIONS",
                                            "JAVA_HOME", "SSL_CERT_FILE")}
if os.path.exists("put.js"):
    res["put"] = run(["node", "put.js"])
    res["node"] = run(["node", "https.js", "localhost", PORT])
    res["node_bare"] = run(["node", "https.js", "localhost", PORT], drop="NODE_EXTRA_CA_CERTS")
if os.path.exists("Main.class"):
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    java = [os.path.join(os.environ["JAVA_HOME"], "bin", "java"),
            "-Dhttps.proxyHost=" + proxy.hostname, "-Dhttps.proxyPort=" + str(proxy.port),
            # localhost is on Java's default no-proxy list (an empty list clears it).
            "-Dhttp.nonProxyHosts=", "-Xmx64m", "-XX:TieredStopAtLevel=1",
            "-XX:+UseSerialGC", "-cp", ".", "Main", PORT]
    res["java"] = run(java)
    res["java_bare"] = run(java, drop="JAVA_TOOL_OPTIONS")
    # What a JVM trusts on an ordinary host: the system's roots, without the run's CA.
    roots = java[:1] + ["-Djavax.net.ssl.trustStore=system.p12",
                        "-Djavax.net.ssl.trustStorePassword=proctor-trust",
                        "-Djavax.net.ssl.trustStoreType=PKCS12"] + java[1:]
    res["java_roots"] = run(roots, drop="JAVA_TOOL_OPTIONS")
print(json.dumps(res), flush=True)
"""


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    d = tmp_path_factory.mktemp("upstream")
    ca = UpstreamCA.make()
    (d / "ca.pem").write_bytes(ca.pem())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ca.issue(["localhost", "127.0.0.1"], d / "leaf.pem"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Auth)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], d / "ca.pem"
    server.shutdown()


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def _run(gov: Gov, backend: str, port: int, ca: Path, extra: dict[str, bytes]) -> dict[str, Any]:
    """One job run by the supervisor with a secret for the upstream (so the broker ends
    its TLS with the run's CA); its entrypoint's JSON line."""
    rt = gov.rt
    host = f"localhost:{port}"
    rt.resources.set_secret("acme", "crm_token", "real-" + SECRET, [host], gov.op)
    rt.resources.set_secret("acme", "crm_token_test", SECRET, [host], gov.op,
                            twin_of="crm_token")  # fmt: skip
    rt.resources.allow_sandbox_host("acme", host, gov.op)
    rt.allow_egress_range("acme", "127.0.0.1/32", gov.op)
    rt.subprocessors.add("acme", "upstream-co", purpose="test upstream", location="here",
                         hosts=[host], actor=gov.op)  # fmt: skip
    art = gov.artifact_dir(
        "runtimes",
        MAIN_PY,
        f"""
        [egress]
        hosts = ["{host}"]
        [secrets]
        names = ["crm_token"]
        [buckets]
        reports = "write"
        [limits]
        timeout = "240s"
        memory = "1GiB"
        pids = 256
        """,
    )
    for name, data in extra.items():
        (art / name).write_bytes(data)
        (art / name).chmod(0o644)
    digest = gov.submit("acme", art)
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "runtimes",
                          environment="sandbox", mode="job", instruction="test", actor=gov.op)  # fmt: skip
    out: list[bytes] = []
    with rt.make_broker(upstream_cafile=str(ca)) as broker:
        record = Supervisor(rt, broker, backend).start(
            "acme", "runtimes", gov.principal("dev").actor, on_stdout=out.append,
            env={"UP_PORT": str(port)},
        )  # fmt: skip
    stdout = b"".join(out).decode()
    stderr = (gov.home / "runs" / record.id / "stderr.log").read_text()
    assert stdout.strip(), (record, stderr)
    res: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    res["_run"] = record.id
    return res


def _node_json(result: dict[str, Any]) -> dict[str, Any]:
    assert result["rc"] == 0 and result["out"], result
    doc: dict[str, Any] = json.loads(result["out"].splitlines()[-1])
    return doc


@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.parametrize("backend", BACKENDS)
def test_node_uploads_chunked_and_trusts_the_run_ca_through_its_own_variable(
    gov: Gov, upstream: tuple[int, Path], backend: str
) -> None:
    port, ca = upstream
    res = _run(gov, backend, port, ca, {"put.js": PUT_JS.encode(), "https.js": HTTPS_JS.encode()})
    assert res["env"]["NODE_EXTRA_CA_CERTS"] == "/opt/proctor-ca/bundle.pem"
    # The upload: sent chunked by Node's default (no Content-Length), stored whole.
    put = _node_json(res["put"])
    expected = bytes((i * 7) % 251 for i in range(300001))
    digest = hashlib.sha256(expected).hexdigest()
    assert put["cl"] is None and put["chunked"] is True, put
    assert put["status"] == 200, put
    assert json.loads(put["body"]) == {"sha256": digest, "bytes": len(expected)}
    stored = gov.rt.home / "buckets"
    found = [p for p in stored.rglob("node.bin") if p.is_file()]
    assert len(found) == 1 and found[0].read_bytes() == expected, found
    writes = [
        json.loads(e) for e in gov.rt.ledger.entries("acme")
        if b'"file.write"' in e and res["_run"].encode() in e
    ]  # fmt: skip
    assert [(w["decision"], w["details"]["sha256"], w["details"]["bytes"]) for w in writes] == [
        ("allow", digest, len(expected))
    ]
    # HTTPS through the broker, which ends the TLS with the run's CA to inject the secret.
    assert _node_json(res["node"]) == {"body": "authorized"}, res["node"]
    bare = _node_json(res["node_bare"])
    assert bare.get("error") in {
        "UNABLE_TO_GET_ISSUER_CERT_LOCALLY", "UNABLE_TO_VERIFY_LEAF_SIGNATURE",
        "SELF_SIGNED_CERT_IN_CHAIN",
    }, bare  # fmt: skip


def _compile_java(tmp: Path) -> bytes:
    src = tmp / "javasrc"
    src.mkdir()
    (src / "Main.java").write_text(MAIN_JAVA)
    assert JAVAC is not None
    subprocess.run([JAVAC, "--release", "17", "-d", str(src), str(src / "Main.java")],
                   check=True, capture_output=True)  # fmt: skip
    return (src / "Main.class").read_bytes()


@pytest.mark.skipif(
    JAVAC is None or not SYSTEM_BUNDLE.exists(), reason="no JDK (javac) or system roots here"
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_java_trusts_the_run_ca_through_its_truststore(
    gov: Gov, upstream: tuple[int, Path], backend: str, tmp_path: Path
) -> None:
    port, ca = upstream
    system = tmp_path / "system"
    system.mkdir()
    shutil.copy(SYSTEM_BUNDLE, system / "bundle.pem")
    roots = java_truststore(system)
    assert roots is not None
    files = {"Main.class": _compile_java(tmp_path), "system.p12": roots.read_bytes()}
    res = _run(gov, backend, port, ca, files)
    opts = res["env"]["JAVA_TOOL_OPTIONS"]
    assert "-Djavax.net.ssl.trustStore=/opt/proctor-ca/truststore-" in opts, res["env"]
    assert res["java"]["out"] == "BODY authorized", res["java"]
    # Without the variable: the JRE's default store (not in the sandbox) gives no
    # anchors at all; the system's roots alone do not take the broker's certificate.
    bare = res["java_bare"]["out"]
    assert bare.startswith("ERROR javax.net.ssl.SSLException"), res["java_bare"]
    assert "trustAnchors parameter must be non-empty" in bare, bare
    with_roots = res["java_roots"]["out"]
    assert with_roots.startswith("ERROR javax.net.ssl.SSLHandshakeException"), res["java_roots"]
    assert "PKIX path building failed" in with_roots, with_roots
