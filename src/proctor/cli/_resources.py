"""``proctor policy``, ``dataset``, ``secret`` and ``bucket``: what a tenant's runs may reach."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from proctor.cli._common import (
    HomeOpt,
    JsonOpt,
    TenantOpt,
    TokenOpt,
    WideOpt,
    authorize_read,
    console,
    emit_json,
    make_table,
    open_runtime,
    print_table,
    remote,
)
from proctor.errors import UsageError
from proctor.ledger import Action, Actor
from proctor.policy import evaluate_request
from proctor.runtime import Runtime

policy_app = typer.Typer(help="A tenant's Cedar policies (deny by default).", no_args_is_help=True)
dataset_app = typer.Typer(help="Datasets only the runtime can open.", no_args_is_help=True)
secret_app = typer.Typer(
    help="Secrets the broker injects; runs never see them.", no_args_is_help=True
)
bucket_app = typer.Typer(
    help="Buckets runs read and write through the broker.", no_args_is_help=True
)


def _read_source(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    path = Path(source)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror}") from exc


@policy_app.command("set")
def policy_set(
    tenant: TenantOpt,
    source: Annotated[str, typer.Argument(help="A .cedar file, or - for standard input")],
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Validate and set the tenant's policy set; recorded with its version."""
    text = _read_source(source)
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        pv = rt.policies.set(tenant, text, rt.operator)
    if as_json:
        emit_json({"tenant": tenant, "version": pv.version, "seq": pv.seq, "set_at": pv.set_at,
                   "set_by": pv.set_by})  # fmt: skip
        return
    console.print(f"policy of [bold]{tenant}[/] set: version {pv.version}")


@policy_app.command("show")
def policy_show(
    tenant: TenantOpt,
    history: Annotated[bool, typer.Option(help="List every version")] = False,
    effective: Annotated[
        bool,
        typer.Option(
            help="The whole set a run of --deployment is decided under: the tenant's set, "
            "the deployment's permits and its environment's forbid"
        ),
    ] = False,
    deployment: Annotated[str | None, typer.Option(help="With --effective: the deployment")] = None,
    version: Annotated[
        int | None,
        typer.Option(help="With --effective: the deployment's version [default: current]"),
    ] = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Print the tenant's current policy text (or its history, or with --effective the
    full set a deployment's runs are decided under)."""
    if effective and (deployment is None or history):
        raise UsageError(
            "--effective needs --deployment, and does not go with --history",
            hint="e.g. proctor policy show -t acme --effective --deployment churn",
        )
    if not effective and (deployment is not None or version is not None):
        raise UsageError("--deployment and --version go with --effective",
                         hint="add --effective")  # fmt: skip
    doc: dict[str, Any]
    if (client := remote(token)) is not None:
        if effective:
            assert deployment is not None
            doc = client.effective_policy(tenant, deployment, version)
        elif history:
            _print_policy_history(tenant, client.policy_history(tenant), as_json, wide)
            return
        else:
            doc = client.policy(tenant)
    else:
        with open_runtime(home) as rt:
            authorize_read(rt, token, tenant, Action.POLICY_READ)
            if effective:
                from proctor.lifecycle import effective_policy

                assert deployment is not None
                doc = effective_policy(rt, tenant, deployment, version)
            elif history:
                versions = [{"tenant": tenant, "seq": pv.seq, "version": pv.version,
                             "set_at": pv.set_at, "set_by": pv.set_by}
                            for pv in rt.policies.history(tenant)]  # fmt: skip
                _print_policy_history(tenant, versions, as_json, wide)
                return
            else:
                pv = rt.policies.current(tenant)
                doc = {"tenant": tenant, "version": pv.version, "text": pv.text}
    text = str(doc.get("text") or "")
    if as_json:
        emit_json({k: v for k, v in doc.items() if effective or k in ("tenant", "version", "text")})
        return
    if effective:
        _effective_head(doc)
    elif not _tenant_head(doc, text):
        return
    sys.stdout.write(text)
    if text and not text.endswith("\n"):
        sys.stdout.write("\n")


def _effective_head(doc: dict[str, Any]) -> None:
    sys.stdout.write(
        f"// the set a run of {doc['deployment']} v{doc['version']} ({doc['environment']}) "
        f"is decided under: version {doc['policy_version']}\n"
        f"// = the tenant's own set ({doc['tenant_policy_version']}), the deployment's "
        "permits, the environment's forbid\n"
    )
    recorded = [v for v in doc.get("recorded") or [] if v != doc["policy_version"]]
    if recorded:
        sys.stdout.write(f"// its runs also recorded: {', '.join(recorded)}\n")


def _tenant_head(doc: dict[str, Any], text: str) -> bool:
    """The head of a tenant's own set; False where it has none (said instead)."""
    if text.strip():
        sys.stdout.write(f"// version {doc['version']}\n")
        return True
    # The hash of nothing, alone, reads as a policy: say there is none, and where
    # the rules a run is decided under are (its deployment's permits, the forbid).
    sys.stdout.write(
        f"// {doc['tenant']} has no policies of its own (version {doc['version']}, "
        "the empty set)\n"
        "// a run is decided under its deployment's permits and its environment's "
        "forbid as well:\n"
        f"// proctor policy show -t {doc['tenant']} --effective --deployment D\n"
    )
    return False


def _print_policy_history(
    tenant: str, versions: list[dict[str, Any]], as_json: bool, wide: bool
) -> None:
    if as_json:
        emit_json([{k: v.get(k) for k in ("tenant", "seq", "version", "set_at", "set_by")}
                   for v in versions])  # fmt: skip
        return
    table = make_table("#", "version", "set at", "by", ids=("version",))
    for v in versions:
        table.add_row(str(v["seq"]), str(v["version"]), str(v["set_at"]), str(v["set_by"]))
    print_table(table, wide)


@policy_app.command("test")
def policy_test(
    tenant: TenantOpt,
    request: Annotated[str, typer.Argument(help="A JSON request file, or - for stdin")],
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Decide one request against the tenant's current policy: decision and reasons."""
    payload = _read_source(request)
    with open_runtime(home) as rt:
        compiled = rt.policies.compiled(tenant)
    decision = evaluate_request(compiled, payload)
    if as_json:
        sys.stdout.write(json.dumps(decision.to_json(), sort_keys=True) + "\n")
    else:
        style = "green" if decision.allowed else "bold red"
        console.print(f"[{style}]{decision.decision}[/] (policy version {decision.version})")
        for pid in decision.policies:
            console.print(f"  by {pid}")
        for err in decision.errors:
            console.print(f"  error: {err}")
    raise typer.Exit(0 if decision.allowed else 1)


@dataset_app.command("add")
def dataset_add(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="The dataset's name, as manifests name it")],
    sqlite: Annotated[Path | None, typer.Option(help="Path of a SQLite database file")] = None,
    postgres_env: Annotated[
        str | None,
        typer.Option(help="Environment variable holding a postgresql:// DSN (kept off argv)"),
    ] = None,
    synthetic: Annotated[
        bool, typer.Option(help="Synthetic data: sandbox runs may use it")
    ] = False,
    twin_of: Annotated[
        str | None, typer.Option(help="The real dataset this synthetic one stands in for")
    ] = None,
    accept_public_grants: Annotated[
        str | None,
        typer.Option(
            metavar="REASON",
            help="Register a PostgreSQL database that grants objects to PUBLIC anyway; "
            "the reason is recorded",
        ),
    ] = None,
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Register a dataset; only the runtime will know where it is."""
    if (sqlite is None) == (postgres_env is None):
        raise UsageError("give exactly one of --sqlite PATH or --postgres-env VAR")
    where: Path | str
    if postgres_env is not None:
        where = os.environ.get(postgres_env, "")
        if not where:
            raise UsageError(f"environment variable {postgres_env} is empty or unset")
    else:
        assert sqlite is not None
        where = sqlite
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        ds = rt.resources.add_dataset(
            tenant, name, where, rt.operator, synthetic=synthetic, twin_of=twin_of,
            accept_public_grants=accept_public_grants,
        )  # fmt: skip
    if as_json:
        emit_json(_dataset_json(ds))
        return
    console.print(f"dataset [bold]{ds.name}[/] registered in {tenant}")


def _dataset_json(ds: Any) -> dict[str, Any]:
    # Not its location: a path or a DSN is the runtime's to know (a DSN may hold a password).
    return {"tenant": ds.tenant, "name": ds.name, "kind": ds.kind, "synthetic": ds.synthetic,
            "twin_of": ds.twin_of}  # fmt: skip


@dataset_app.command("list")
def dataset_list(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """A tenant's datasets: name, kind, and whether each is synthetic (never where they are)."""
    with open_runtime(home) as rt:
        authorize_read(rt, token, tenant, Action.TENANT_READ)
        rt.tenants.get(tenant)  # -t nope: unknown tenant, not an empty list
        rows = rt.resources.datasets(tenant)
    if as_json:
        emit_json([_dataset_json(ds) for ds in rows])
        return
    table = make_table("dataset", "kind", "synthetic", "twin of", ids=("dataset", "twin of"))
    for ds in rows:
        table.add_row(ds.name, ds.kind, "yes" if ds.synthetic else "no", ds.twin_of or "")
    print_table(table, wide)


@dataset_app.command("describe")
def dataset_describe(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="The dataset's name")],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """A dataset's tables and views, their columns and types, from the database's own
    catalog: what a manifest names. Never a row, never where the dataset is."""
    from proctor.cli._common import acting
    from proctor.policy import EntityRef

    if (client := remote(token)) is not None:
        doc = client.describe_dataset(tenant, name)
    else:
        with open_runtime(home) as rt:
            actor, principal = acting(rt, token)
            log = tenant
            if principal is not None:
                rt.control.authorize(principal, Action.DATASET_DESCRIBE,
                                     EntityRef.dataset(tenant, name), tenant,
                                     event_resource=f"dataset/{name}")  # fmt: skip
                log = principal.tenant
            rt.tenants.get(tenant)
            doc = rt.describe_dataset(tenant, name, actor, log, {})
    if as_json:
        emit_json(doc)
        return
    from rich.markup import escape

    # Names come from the database: escaped, so none is taken for markup.
    for t in doc["tables"]:
        console.print(f"[bold]{escape(t['name'])}[/]" + (" (view)" if t["kind"] == "view" else ""))
        for c in t["columns"]:
            flags = ("primary key" if c["primary_key"] else "",
                     "" if c["nullable"] else "not null")  # fmt: skip
            extra = ", ".join(f for f in flags if f)
            console.print(
                f"  {escape(c['name']):24} {escape(c['type']) or '-'}"
                + (f"  ({extra})" if extra else "")
            )


@secret_app.command("set")
def secret_set(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="The secret's name, as manifests name it")],
    host: Annotated[list[str], typer.Option("--host", help="A host the secret is sent to")],
    from_env: Annotated[
        str | None, typer.Option(help="Read the value from this environment variable")
    ] = None,
    header: Annotated[str, typer.Option(help="Header to inject")] = "Authorization",
    template: Annotated[str, typer.Option(help="Header value; {secret} is replaced")] = (
        "Bearer {secret}"
    ),
    twin_of: Annotated[
        str | None,
        typer.Option(help="A test secret: sandbox runs of code naming this real one get it"),
    ] = None,
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Store a secret, sealed; its value comes from stdin (or --from-env), never argv."""
    if from_env is not None:
        value = os.environ.get(from_env, "")
        if not value:
            raise UsageError(f"environment variable {from_env} is empty or unset")
    else:
        value = sys.stdin.readline().rstrip("\n")
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        secret = rt.resources.set_secret(
            tenant,
            name,
            value,
            host,
            rt.operator,
            header=header,
            template=template,
            twin_of=twin_of,
        )
    if as_json:
        emit_json(_secret_json(secret))
        return
    console.print(f"secret [bold]{secret.name}[/] set for {', '.join(secret.hosts)}")


def _secret_json(s: Any) -> dict[str, Any]:
    # Never the value: it is sealed, and only the broker opens it, at injection.
    return {"tenant": s.tenant, "name": s.name, "hosts": list(s.hosts), "header": s.header,
            "template": s.template, "twin_of": s.twin_of}  # fmt: skip


@secret_app.command("list")
def secret_list(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """A tenant's secrets: where each is sent and in which header (never the value)."""
    with open_runtime(home) as rt:
        authorize_read(rt, token, tenant, Action.TENANT_READ)
        rt.tenants.get(tenant)  # -t nope: unknown tenant, not an empty list
        rows = rt.resources.secrets(tenant)
    if as_json:
        emit_json([_secret_json(s) for s in rows])
        return
    table = make_table("secret", "hosts", "header", "test twin of", ids=("secret", "hosts"))
    for s in rows:
        table.add_row(s.name, ", ".join(s.hosts), s.header, s.twin_of or "")
    print_table(table, wide)


@bucket_app.command("add")
def bucket_add(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="The bucket's name, as manifests name it")],
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Create a bucket runs may read and write through the broker."""
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        rt.resources.add_bucket(tenant, name, rt.operator)
    if as_json:
        emit_json({"tenant": tenant, "name": name})
        return
    console.print(f"bucket [bold]{name}[/] created in {tenant}")


@bucket_app.command("list")
def bucket_list(
    tenant: TenantOpt, as_json: JsonOpt = False, token: TokenOpt = None, home: HomeOpt = None
) -> None:
    """A tenant's buckets."""
    with open_runtime(home) as rt:
        authorize_read(rt, token, tenant, Action.TENANT_READ)
        rt.tenants.get(tenant)  # -t nope: unknown tenant, not an empty list
        names = list(rt.resources.buckets(tenant))
    if as_json:
        emit_json([{"tenant": tenant, "name": name} for name in names])
        return
    for name in names:
        console.print(name)


# -- a bucket's objects: what a job wrote, fetched by a person -----------------------

BucketArg = Annotated[str, typer.Argument(help="The bucket's name", show_default=False)]
KeyArg = Annotated[
    str, typer.Argument(help="The object's key, e.g. reports/churn.csv", show_default=False)
]


def _bucket_actor(tenant: str, bucket: str, action: str, what: str, token: str | None,
                  rt: Runtime) -> Actor:  # fmt: skip
    """Who acts; a principal is decided by Cedar (refusals recorded), the local
    operator owns the runtime."""
    from proctor.cli._common import acting
    from proctor.governance import bucket_problem
    from proctor.policy import EntityRef

    actor, principal = acting(rt, token)
    if principal is not None:
        problem = bucket_problem(bucket)
        if problem is not None:
            raise UsageError(f"bucket {bucket!r}: {problem}")
        rt.control.authorize(
            principal, action, EntityRef.bucket(tenant, bucket), tenant, event_resource=what
        )
    return actor


@bucket_app.command("objects")
def bucket_objects(
    tenant: TenantOpt,
    bucket: BucketArg,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """List a bucket's objects: key, size, SHA-256 and when each was last written."""
    from proctor.cli._common import remote

    rows: list[dict[str, Any]]
    if (client := remote(token)) is not None:
        rows = list(client.bucket_objects(tenant, bucket))
    else:
        with open_runtime(home) as rt:
            rt.tenants.get(tenant)
            actor = _bucket_actor(tenant, bucket, Action.BUCKET_READ, f"bucket/{bucket}", token, rt)
            rows = [o.__dict__ for o in rt.resources.objects(tenant, bucket, actor)]
    if as_json:
        emit_json(rows)
        return
    table = make_table("key", "size", "sha256", "modified", ids=("key", "sha256"))
    for o in rows:
        table.add_row(o["key"], str(o["size"]), o["sha256"], o["modified"])
    print_table(table, wide)


@bucket_app.command("get")
def bucket_get(
    tenant: TenantOpt,
    bucket: BucketArg,
    key: KeyArg,
    output: Annotated[
        str,
        typer.Option(
            "--output", "-o", help="File to write the exact bytes to (default '-': stdout)"
        ),
    ] = "-",
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Fetch an object's exact bytes, to stdout (like `artifact cat`) or to -o FILE; the
    read is recorded with their SHA-256 and size. With --json (and -o FILE): one object
    saying what was written where."""
    if as_json and output == "-":
        raise UsageError(
            "with -o -, stdout carries the object's bytes; --json needs -o FILE",
            hint="`proctor bucket objects --json` lists keys, sizes and digests",
        )
    from proctor.cli._common import remote

    if (client := remote(token)) is not None:
        data = client.get_object(tenant, bucket, key)
    else:
        with open_runtime(home) as rt:
            rt.tenants.get(tenant)
            actor = _bucket_actor(
                tenant, bucket, Action.BUCKET_READ, f"bucket/{bucket}/{key}", token, rt
            )
            data = rt.resources.get_object(tenant, bucket, key, actor)
    if output == "-":
        _to_stdout(data, bucket, key)
        return
    try:
        Path(output).write_bytes(data)
    except OSError as exc:
        raise UsageError(f"cannot write {output}: {exc.strerror}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if as_json:
        emit_json({"bucket": bucket, "key": key, "size": len(data), "sha256": digest,
                   "written": output})  # fmt: skip
        return
    console.print(f"{len(data)} bytes written to {output} (sha256 {digest})")


def _to_stdout(data: bytes, bucket: str, key: str) -> None:
    """An object's bytes to stdout: exact when piped; on a terminal, text is shown with
    its control characters spelled out (as `artifact cat` does) and binary is refused,
    where its bytes would act on the terminal rather than show (the read is recorded)."""
    if sys.stdout.isatty():
        from proctor.cli._artifacts import visible_text

        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or "\0" in text:
            raise UsageError(
                f"{bucket}/{key} is binary ({len(data)} bytes): not written to a terminal",
                hint=f"-o FILE writes it to a file, or pipe stdout "
                f"(`proctor bucket get ... {bucket} {key} > FILE`)",
            )
        data = visible_text(data).encode()
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


@bucket_app.command("put")
def bucket_put(
    tenant: TenantOpt,
    bucket: BucketArg,
    key: KeyArg,
    file: Annotated[Path, typer.Argument(help="The file to upload ('-': stdin)")],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Write an object (admins and the local operator); recorded with its SHA-256 and
    size before it becomes visible to runs."""
    from proctor.cli._common import remote

    try:
        data = sys.stdin.buffer.read() if str(file) == "-" else file.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {file}: {exc.strerror}") from exc
    doc: dict[str, Any]
    if (client := remote(token)) is not None:
        doc = dict(client.put_object(tenant, bucket, key, data))
    else:
        with open_runtime(home) as rt:
            rt.tenants.get(tenant)
            actor = _bucket_actor(
                tenant, bucket, Action.BUCKET_WRITE, f"bucket/{bucket}/{key}", token, rt
            )
            doc = rt.resources.put_object(tenant, bucket, key, data, actor).__dict__
    if as_json:
        emit_json(doc)
        return
    console.print(f"{doc['size']} bytes written to {bucket}/{doc['key']} (sha256 {doc['sha256']})")
