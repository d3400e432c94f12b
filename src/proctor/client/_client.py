"""The Python SDK over the HTTP API; the CLI's ``--server`` mode uses it too.

Every method is one request. A response with an error is raised as the
``proctor`` exception its stable ``code`` names (``not_found`` as ``NotFound``,
``forbidden`` as ``ControlDenied``, ``ledger_unavailable`` as ``LedgerError``,
…), with ``status``, ``code`` and ``request_id`` attached, so that callers
handle remote and embedded errors alike.
"""

from __future__ import annotations

import io
import json
import os
import ssl
import tarfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import quote

import httpx

from proctor.errors import ProctorError, UsageError, class_of

Json = Any


class RemoteError(ProctorError):
    """An API error whose code this client does not know (a newer server)."""


def error_from_response(status: int, payload: Json, request_id: str | None) -> ProctorError:
    """The exception an error response stands for: the class its code names in
    ``proctor.errors``' table, ``RemoteError`` for a code this version does not know."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        err = {"code": "internal", "message": f"HTTP {status} without a Proctor error body"}
    code = str(err.get("code") or "internal")
    message = str(err.get("message") or f"HTTP {status}")
    hint = err.get("hint") if isinstance(err.get("hint"), str) else None
    exc = (class_of(code) or RemoteError)(message, hint=hint)
    exc.status = status
    exc.code = code
    exc.request_id = err.get("request_id") or request_id
    return exc


def pack_directory(directory: Path) -> bytes:
    """An artifact directory as a tar.gz, names relative to it, symlinks kept as links."""
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for root, dirs, files in os.walk(directory):
            dirs.sort()
            for name in sorted(dirs + files):
                path = Path(root) / name
                rel = PurePosixPath(path.relative_to(directory).as_posix())
                if path.is_dir() and not path.is_symlink():
                    continue
                tar.add(path, arcname=str(rel), recursive=False)
    return buf.getvalue()


def _tile_path(level: int, index: int, width: int) -> str:
    # The C2SP tlog-tiles URL path, written here like every other path of the API:
    # the SDK imports nothing of the server (proctor.ledger.tile_path is the same rule,
    # and tests/unit/test_client_tiles.py holds them equal).
    digits = f"{index:03d}"
    while len(digits) % 3:
        digits = "0" + digits
    groups = [digits[i : i + 3] for i in range(0, len(digits), 3)]
    n = "/".join([f"x{g}" for g in groups[:-1]] + [groups[-1]])
    suffix = "" if width == 256 else f".p/{width}"
    return f"tile/{level}/{n}{suffix}"


def _seg(value: str) -> str:
    return quote(value, safe=":")


class Client:
    """``Client(url, token)``: a principal's view of a Proctor server.

    ``verify`` is passed to httpx: ``True`` (system CAs), ``False``, or a CA bundle
    path for a server with its own certificate. ``headers`` go with every request
    (the console passes its request id and the person's address this way).
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 60.0,
        verify: bool | str = True,
        transport: httpx.BaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        tls = ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
        self._http = httpx.Client(
            base_url=self.url,
            headers={
                "User-Agent": "proctor-client",
                **(headers or {}),
                "Authorization": f"Bearer {token}",
            },
            timeout=timeout,
            verify=tls,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------

    def _raise(self, resp: httpx.Response) -> None:
        if resp.is_success:
            return
        try:
            payload = resp.json()
        except ValueError:
            payload = None
        raise error_from_response(resp.status_code, payload, resp.headers.get("x-request-id"))

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise ProctorError(f"cannot reach {self.url}: {exc}") from exc
        self._raise(resp)
        return resp

    def _json(self, method: str, path: str, **kw: Any) -> Json:
        return self._request(method, path, **kw).json()

    def _t(self, tenant: str) -> str:
        return f"/tenants/{_seg(tenant)}"

    # -- meta, tenants, principals ------------------------------------------------

    def health(self) -> Json:
        return self._json("GET", "/healthz")

    def verifier_key(self) -> str:
        return str(self._json("GET", "/key")["verifier_key"])

    def whoami(self) -> Json:
        return self._json("GET", "/whoami")

    def tenants(self) -> Json:
        return self._json("GET", "/tenants")

    def tenant(self, tenant: str) -> Json:
        return self._json("GET", self._t(tenant))

    def freeze(self, tenant: str, reason: str = "") -> Json:
        return self._json("POST", f"{self._t(tenant)}/freeze", json={"reason": reason})

    def unfreeze(self, tenant: str, reason: str = "") -> Json:
        return self._json("POST", f"{self._t(tenant)}/unfreeze", json={"reason": reason})

    def principals(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/principals")

    def principal(self, tenant: str, name: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/principals/{_seg(name)}")

    def create_principal(
        self, tenant: str, name: str, roles: list[str], *, service: bool = False
    ) -> tuple[Json, str]:
        """Create a principal; returns it and its token (shown this once)."""
        doc = self._json(
            "POST",
            f"{self._t(tenant)}/principals",
            json={"name": name, "roles": roles, "kind": "service" if service else "user"},
        )
        return doc["principal"], str(doc["token"])

    def rotate_token(self, tenant: str, name: str) -> str:
        return str(self._json("POST", f"{self._t(tenant)}/principals/{_seg(name)}/token")["token"])

    def disable_principal(self, tenant: str, name: str) -> Json:
        return self._json("POST", f"{self._t(tenant)}/principals/{_seg(name)}/disable")

    def enable_principal(self, tenant: str, name: str) -> Json:
        return self._json("POST", f"{self._t(tenant)}/principals/{_seg(name)}/enable")

    # -- policies, quorum, resources -----------------------------------------------

    def policy(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/policy")

    def set_policy(self, tenant: str, text: str) -> Json:
        return self._json("PUT", f"{self._t(tenant)}/policy", json={"text": text})

    def policy_history(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/policy/history")

    def effective_policy(self, tenant: str, deployment: str, version: int | None = None) -> Json:
        """The whole set a run of ``deployment`` is decided under (text and version)."""
        params: dict[str, Any] = {"deployment": deployment}
        if version is not None:
            params["version"] = version
        return self._json("GET", f"{self._t(tenant)}/policy/effective", params=params)

    def test_policy(self, tenant: str, request: Mapping[str, Any]) -> Json:
        return self._json("POST", f"{self._t(tenant)}/policy/test", json=dict(request))

    def quorum(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/quorum")

    def set_quorum(self, tenant: str, required: int, roles: list[str] | None = None) -> Json:
        body = {"required": required, "roles": roles or []}
        return self._json("PUT", f"{self._t(tenant)}/quorum", json=body)

    def datasets(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/datasets")

    def secrets(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/secrets")

    def subprocessors(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/subprocessors")

    def set_secret(
        self, tenant: str, name: str, value: str, hosts: list[str], *,
        header: str = "Authorization", template: str = "Bearer {secret}",
        twin_of: str | None = None,
    ) -> Json:  # fmt: skip
        body = {"value": value, "hosts": hosts, "header": header, "template": template,
                "twin_of": twin_of}  # fmt: skip
        return self._json("PUT", f"{self._t(tenant)}/secrets/{_seg(name)}", json=body)

    def buckets(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/buckets")

    # -- private upstreams: CA certificates registered for hosts -------------------

    def egress_cas(self, tenant: str) -> Json:
        """``[{host, cas: [{fingerprint, subject, not_after, added_at, added_by}]}]``."""
        return self._json("GET", f"{self._t(tenant)}/egress/cas")

    def add_egress_ca(self, tenant: str, host: str, pem: str | bytes) -> Json:
        """Register PEM CA certificate(s) for ``host``: the broker verifies the host
        against them alone. The host's registrations after the change."""
        text = pem.decode("ascii", "replace") if isinstance(pem, bytes) else pem
        return self._json("POST", f"{self._t(tenant)}/egress/cas/{_seg(host)}",
                          json={"pem": text})  # fmt: skip

    def remove_egress_ca(self, tenant: str, host: str, fingerprint: str | None = None) -> Json:
        """Remove ``host``'s CA certificates (only ``fingerprint``'s, if given); what is left."""
        params = {} if fingerprint is None else {"fingerprint": fingerprint}
        return self._json("DELETE", f"{self._t(tenant)}/egress/cas/{_seg(host)}", params=params)

    def _object_path(self, tenant: str, bucket: str, key: str) -> str:
        # Every '/' and '.' escaped: the key reaches the server as given (a '..' in it
        # is refused there), never resolved away by URL normalisation on the way.
        escaped = quote(key, safe="").replace(".", "%2E")
        return f"{self._t(tenant)}/buckets/{_seg(bucket)}/objects/{escaped}"

    def bucket_objects(self, tenant: str, bucket: str) -> Json:
        """The bucket's objects: ``[{key, size, sha256, modified}]``, sorted by key."""
        return self._json("GET", f"{self._t(tenant)}/buckets/{_seg(bucket)}/objects")

    def get_object(self, tenant: str, bucket: str, key: str) -> bytes:
        """An object's exact bytes."""
        return self._request("GET", self._object_path(tenant, bucket, key)).content

    def put_object(self, tenant: str, bucket: str, key: str, data: bytes) -> Json:
        """Write an object; returns ``{key, size, sha256, modified}``."""
        return self._json(
            "PUT", self._object_path(tenant, bucket, key), content=data,
            headers={"Content-Type": "application/octet-stream"},
        )  # fmt: skip

    def run_receipt(self, tenant: str, run_id: str) -> str:
        """A production run's signed receipt (C2SP tlog-proof), exactly as written."""
        return self._request("GET", f"{self._t(tenant)}/runs/{_seg(run_id)}/receipt").text

    # -- artifacts and approvals ----------------------------------------------------

    def submit_artifact(self, tenant: str, source: Path | bytes) -> Json:
        """Submit a directory (packed here) or a ready tar / tar.gz."""
        data = source if isinstance(source, bytes) else pack_directory(source)
        ctype = "application/gzip" if data[:2] == b"\x1f\x8b" else "application/x-tar"
        return self._json(
            "POST", f"{self._t(tenant)}/artifacts", content=data, headers={"Content-Type": ctype}
        )

    def artifacts(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/artifacts")

    def artifact(self, tenant: str, digest: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/artifacts/{_seg(digest)}")

    def diff(self, tenant: str, old: str, new: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/artifacts/{_seg(old)}/diff/{_seg(new)}")

    def artifact_file(self, tenant: str, digest: str, path: str) -> bytes:
        """The exact bytes of one file of the artifact (``path`` as the artifact lists it)."""
        url = f"{self._t(tenant)}/artifacts/{_seg(digest)}/files/{_file_path(path)}"
        return self._request("GET", url).content

    def download_artifact(self, tenant: str, digest: str, out: BinaryIO) -> str:
        """Write the artifact's exact tree as a tar to ``out``; returns its full digest."""
        url = f"{self._t(tenant)}/artifacts/{_seg(digest)}/tar"
        try:
            with self._http.stream("GET", url) as resp:
                if not resp.is_success:
                    resp.read()
                    self._raise(resp)
                for chunk in resp.iter_bytes():
                    out.write(chunk)
                return str(resp.headers.get("x-proctor-digest", digest))
        except httpx.HTTPError as exc:
            raise ProctorError(f"cannot reach {self.url}: {exc}") from exc

    def review(self, tenant: str, digest: str) -> Json:
        """What an approver sees before approving: capabilities in words, purpose, files,
        the sandbox runs of this digest with their calls and refusals, the approvals."""
        return self._json("GET", f"{self._t(tenant)}/artifacts/{_seg(digest)}/review")

    def approvals(self, tenant: str, digest: str | None = None) -> Json:
        """Approvals and rejections, oldest first: of one artifact, or of the tenant's all."""
        if digest is None:
            return self._json("GET", f"{self._t(tenant)}/approvals")
        return self._json("GET", f"{self._t(tenant)}/artifacts/{_seg(digest)}/approvals")

    def approve(
        self, tenant: str, digest: str, *, expires_seconds: int = 30 * 86400, comment: str = ""
    ) -> Json:
        body = {"expires_seconds": expires_seconds, "comment": comment}
        return self._json(
            "POST", f"{self._t(tenant)}/artifacts/{_seg(digest)}/approvals", json=body
        )

    def reject(self, tenant: str, digest: str, comment: str = "") -> Json:
        path = f"{self._t(tenant)}/artifacts/{_seg(digest)}/rejections"
        return self._json("POST", path, json={"comment": comment})

    def approval(self, tenant: str, approval_id: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/approvals/{_seg(approval_id)}")

    def revoke(self, tenant: str, approval_id: str) -> Json:
        return self._json("POST", f"{self._t(tenant)}/approvals/{_seg(approval_id)}/revoke")

    # -- deployments and runs ---------------------------------------------------------

    def deployments(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/deployments")

    def deploy(
        self, tenant: str, digest: str, name: str, *, instruction: str,
        environment: str = "sandbox", mode: str | None = None,
        every_seconds: float | None = None,
        reference: str = "",
    ) -> Json:  # fmt: skip
        body = {
            "digest": digest, "name": name, "environment": environment, "mode": mode,
            "every_seconds": every_seconds, "instruction": instruction, "reference": reference,
        }  # fmt: skip
        return self._json("POST", f"{self._t(tenant)}/deployments", json=body)

    def deployment(self, tenant: str, name: str) -> Json:
        """Every version of the deployment, oldest first."""
        return self._json("GET", f"{self._t(tenant)}/deployments/{_seg(name)}")

    def rollback(self, tenant: str, name: str) -> Json:
        return self._json("POST", f"{self._t(tenant)}/deployments/{_seg(name)}/rollback")

    def stop_deployment(self, tenant: str, name: str, reason: str = "stopped by request") -> Json:
        path = f"{self._t(tenant)}/deployments/{_seg(name)}/stop"
        return self._json("POST", path, json={"reason": reason})

    def run(
        self,
        tenant: str,
        name: str,
        *,
        on_stdout: Callable[[str], object] | None = None,
        on_stderr: Callable[[str], object] | None = None,
    ) -> Json:
        """Run a job deployment, passing its output to the callbacks as it comes;
        returns the finished run's record."""
        path = f"{self._t(tenant)}/deployments/{_seg(name)}/runs"
        try:
            with self._http.stream("POST", path, timeout=None) as resp:
                if not resp.is_success:
                    resp.read()
                    self._raise(resp)
                for line in resp.iter_lines():
                    if not line:
                        continue
                    doc = json.loads(line)
                    if "run" in doc:
                        return doc["run"]
                    if "error" in doc:
                        raise error_from_response(500, doc, resp.headers.get("x-request-id"))
                    sink = on_stdout if doc.get("stream") == "stdout" else on_stderr
                    if sink is not None:
                        sink(str(doc.get("data", "")))
        except httpx.HTTPError as exc:
            raise ProctorError(f"the run's stream from {self.url} broke: {exc}") from exc
        raise ProctorError("the run's stream ended without its record")

    def runs(
        self, tenant: str, deployment: str | None = None, *, status: str | None = None,
        since: str | None = None, mine: bool = False,
    ) -> Json:  # fmt: skip
        """A tenant's runs; ``status``, ``since`` (ISO 8601) and ``mine`` (those this
        token's principal started) are decided on the server."""
        params: dict[str, str] = {}
        if deployment:
            params["deployment"] = deployment
        if status:
            params["status"] = status
        if since:
            params["since"] = since
        if mine:
            params["mine"] = "true"
        return self._json("GET", f"{self._t(tenant)}/runs", params=params)

    def get_run(self, tenant: str, run_id: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/runs/{_seg(run_id)}")

    def run_logs(
        self, tenant: str, run_id: str, *, stream: str = "stdout", follow: bool = False
    ) -> Iterator[bytes]:
        path = f"{self._t(tenant)}/runs/{_seg(run_id)}/logs"
        params = {"stream": stream, "follow": "true" if follow else "false"}
        with self._http.stream("GET", path, params=params, timeout=None) as resp:
            if not resp.is_success:
                resp.read()
                self._raise(resp)
            yield from resp.iter_bytes()

    def history(self, tenant: str, at: str, window_seconds: float = 3600.0) -> Json:
        params = {"at": at, "window_seconds": window_seconds}
        return self._json("GET", f"{self._t(tenant)}/history", params=params)

    # -- the ledger ------------------------------------------------------------------

    def events(
        self, tenant: str, *, start: int = 0, limit: int = 1000,
        since: str | None = None, until: str | None = None,
        run: str | None = None, action: str | None = None, decision: str | None = None,
        newest: bool = False, actor: str | None = None,
    ) -> list[bytes]:  # fmt: skip
        """One page of events, each the canonical bytes exactly as hashed; the filters
        combine. With ``newest``, the newest ``limit`` matches instead of a page from
        ``start``. ``run`` takes any unique prefix of a run id."""
        params = _event_params(since, until, run, action, decision, actor)
        params.update(start=start, limit=limit, newest="true" if newest else "false")
        resp = self._request("GET", f"{self._t(tenant)}/events", params=params)
        return [line for line in resp.content.split(b"\n") if line]

    def iter_events(
        self, tenant: str, *, since: str | None = None, until: str | None = None,
        run: str | None = None, action: str | None = None, decision: str | None = None,
        start: int = 0, actor: str | None = None,
    ) -> Iterator[bytes]:  # fmt: skip
        """Every matching event from ``start`` on, page after page."""
        params = _event_params(since, until, run, action, decision, actor)
        while True:
            params.update(start=start, limit=1000)
            resp = self._request("GET", f"{self._t(tenant)}/events", params=params)
            yield from (line for line in resp.content.split(b"\n") if line)
            nxt = resp.headers.get("x-next-start")
            if nxt is None:
                return
            start = int(nxt)

    def follow_events(
        self, tenant: str, *, start: int | None = None,
        run: str | None = None, action: str | None = None, decision: str | None = None,
        on_open: Callable[[int], None] | None = None,
    ) -> Iterator[bytes]:  # fmt: skip
        """Matching events as they are appended (from the log's end, or ``start``),
        one at a time, until the caller stops iterating. ``on_open`` is called with
        the first sequence number the stream covers, once it is open."""
        params = _event_params(None, None, run, action, decision)
        if start is not None:
            params["start"] = start
        path = f"{self._t(tenant)}/events/follow"
        with self._http.stream("GET", path, params=params, timeout=None) as resp:
            if not resp.is_success:
                resp.read()
                self._raise(resp)
            if on_open is not None:
                on_open(int(resp.headers.get("x-start", "0")))
            for line in resp.iter_lines():
                if line:
                    yield line.encode()

    def checkpoint(self, tenant: str) -> str:
        """The latest signed checkpoint, exactly as signed."""
        return self._request("GET", f"{self._t(tenant)}/log/checkpoint").text

    def checkpoints(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/checkpoints")

    def tile(self, tenant: str, level: int, index: int, width: int = 256) -> bytes:
        return self._request(
            "GET", f"{self._t(tenant)}/log/{_tile_path(level, index, width)}"
        ).content

    def inclusion_proof(self, tenant: str, index: int, size: int | None = None) -> Json:
        params: dict[str, Any] = {"index": index}
        if size is not None:
            params["size"] = size
        return self._json("GET", f"{self._t(tenant)}/proofs/inclusion", params=params)

    def consistency_proof(self, tenant: str, old: int, new: int | None = None) -> Json:
        params: dict[str, Any] = {"old": old}
        if new is not None:
            params["new"] = new
        return self._json("GET", f"{self._t(tenant)}/proofs/consistency", params=params)

    def verify(self, tenant: str) -> Json:
        return self._json("GET", f"{self._t(tenant)}/verify")

    def evidence_pack(self, tenant: str, since: str, until: str, dest: Path) -> Json:
        """Write the evidence pack of [since, until) to ``dest`` (a new file); returns
        its figures (events, first_seq, end_seq, context, end_size)."""
        if dest.exists():
            raise UsageError(f"{dest} exists already")
        resp = self._request("GET", f"{self._t(tenant)}/evidence",
                             params={"from": since, "to": until})  # fmt: skip
        try:
            dest.write_bytes(resp.content)
        except OSError as exc:
            raise UsageError(f"cannot write {dest}: {exc.strerror}") from exc
        return dict(json.loads(resp.headers.get("X-Evidence-Pack", "{}")))

    def export_archive(self, tenant: str) -> bytes:
        """The log export as the server sends it: a tar.gz of what ``export`` unpacks."""
        return self._request("GET", f"{self._t(tenant)}/export").content

    def export(self, tenant: str, dest: Path) -> Path:
        """Download the log export and unpack it into ``dest`` (created; must be empty);
        ``proctor audit verify --from-export`` then checks it offline."""
        data = self._request("GET", f"{self._t(tenant)}/export").content
        dest.mkdir(parents=True, exist_ok=True)
        if any(dest.iterdir()):
            raise UsageError(f"export directory {dest} is not empty")
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = tar.getmembers()
            prefix = members[0].name.split("/")[0] if members else ""
            for m in members:
                rel = m.name[len(prefix) :].lstrip("/")
                if not rel:
                    continue
                m.name = rel
                tar.extract(m, dest, filter="data")
        return dest

    # -- retention, legal holds, erasure (operators and admins) -------------------

    def retention(self, tenant: str) -> Json:
        """The rule in force, the active holds, and the retention record."""
        return self._json("GET", f"{self._t(tenant)}/retention")

    def set_retention(
        self, tenant: str, days: int, *, below_legal_minimum: str | None = None
    ) -> Json:
        body: dict[str, Any] = {"days": days}
        if below_legal_minimum is not None:
            body["below_legal_minimum"] = below_legal_minimum
        return self._json("PUT", f"{self._t(tenant)}/retention", json=body)

    def prune(self, tenant: str) -> Json:
        return self._json("POST", f"{self._t(tenant)}/retention/prune")

    def holds(self, tenant: str, *, include_removed: bool = False) -> Json:
        params = {"all": "true"} if include_removed else {}
        return self._json("GET", f"{self._t(tenant)}/holds", params=params)

    def add_hold(
        self, tenant: str, reason: str, *, run: str | None = None, deployment: str | None = None
    ) -> Json:
        """A legal hold on the tenant, or on one run or deployment (give one of them)."""
        body: dict[str, Any] = {"scope": "tenant", "target": None, "reason": reason}
        if run is not None:
            body.update(scope="run", target=run)
        elif deployment is not None:
            body.update(scope="deployment", target=deployment)
        return self._json("POST", f"{self._t(tenant)}/holds", json=body)

    def remove_hold(self, tenant: str, hold_id: str) -> Json:
        return self._json("DELETE", f"{self._t(tenant)}/holds/{_seg(hold_id)}")

    def erase(self, tenant: str, dataset: str, key: str, request_ref: str) -> Json:
        """Erase one record key from the lineage record (an admin's call)."""
        body = {"dataset": dataset, "key": key, "request_ref": request_ref}
        return self._json("POST", f"{self._t(tenant)}/erasures", json=body)

    # -- agents (issue 35): agent principals, approval requests, dataset descriptions --

    def create_agent(self, tenant: str, name: str, responsible: str) -> tuple[Json, str]:
        """Create an AI agent principal (an admin's call): it holds the agent role alone
        and names the person or team ``responsible`` for it. Returns it and its token."""
        doc = self._json(
            "POST",
            f"{self._t(tenant)}/principals",
            json={"name": name, "kind": "agent", "responsible": responsible},
        )
        return doc["principal"], str(doc["token"])

    def request_approval(self, tenant: str, digest: str, comment: str = "") -> Json:
        """Ask the tenant's approvers to approve ``digest`` (recorded; approves nothing)."""
        path = f"{self._t(tenant)}/artifacts/{_seg(digest)}/approval-requests"
        return self._json("POST", path, json={"comment": comment})

    def approval_state(self, tenant: str, digest: str) -> Json:
        """Who asked, the approvals and rejections in force, the quorum, approved or not."""
        return self._json("GET", f"{self._t(tenant)}/artifacts/{_seg(digest)}/approval-state")

    def describe_dataset(self, tenant: str, name: str) -> Json:
        """A dataset's tables, columns and types from its catalog (never a row)."""
        return self._json("GET", f"{self._t(tenant)}/datasets/{_seg(name)}/schema")

    # -- manifests learned from runs (issue 35) ---------------------------------------

    def suggest_manifest(self, tenant: str, run: str) -> Json:
        """The least-privilege manifest run ``run``'s calls called for (its id or any
        unique prefix): ``manifest`` (TOML), ``diff`` against its artifact's manifest,
        ``lines`` (each added or removed line with its reason and the event's ``seq``),
        ``not_suggestable`` (refusals no manifest line lifts, with why)."""
        return self._json("GET", f"{self._t(tenant)}/runs/{_seg(run)}/suggested-manifest")

    # -- calls that ask a person (issue 35) -------------------------------------------

    def asked_calls(self, tenant: str, run: str | None = None, state: str | None = None) -> Json:
        """The tenant's asked calls (capabilities marked ``ask``), pending first: each
        with its run, call, exact arguments, state and the seqs of its events."""
        given = {"run": run, "state": state}
        params = {k: v for k, v in given.items() if v is not None}
        return self._json("GET", f"{self._t(tenant)}/asks", params=params)

    def asked_call(self, tenant: str, ask_id: str) -> Json:
        """One asked call."""
        return self._json("GET", f"{self._t(tenant)}/asks/{_seg(ask_id)}")

    def answer_call(self, tenant: str, ask_id: str, approve: bool, comment: str = "") -> Json:
        """Approve or deny an asked call (an approver who is not the code's author);
        ``AlreadyAnswered`` if it has its one answer already."""
        verb = "approve" if approve else "deny"
        path = f"{self._t(tenant)}/asks/{_seg(ask_id)}/{verb}"
        return self._json("POST", path, json={"comment": comment})


def _event_params(
    since: str | None, until: str | None, run: str | None, action: str | None,
    decision: str | None, actor: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    given = {"since": since, "until": until, "run": run, "action": action, "decision": decision,
             "actor": actor}  # fmt: skip
    return {k: v for k, v in given.items() if v is not None}


def _file_path(path: str) -> str:
    """An artifact path in a URL, each segment quoted; "." and ".." are escaped so that
    no client or proxy folds them away: the server sees them, and refuses them."""
    parts = [quote(p, safe="") for p in path.split("/")]
    return "/".join(p.replace(".", "%2E") if p in (".", "..") else p for p in parts)
