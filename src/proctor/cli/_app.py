from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from typer._click import exceptions as _click_exceptions
from typer._click import types as _click_types

from proctor import __version__
from proctor.cli import _print_error
from proctor.cli._artifacts import artifact_app
from proctor.cli._ask import register as register_ask
from proctor.cli._audit import audit_app
from proctor.cli._backup import register as register_backup
from proctor.cli._common import (
    REMOTE,
    HomeOpt,
    JsonOpt,
    WideOpt,
    console,
    emit_json,
    make_table,
    open_runtime,
    print_table,
)
from proctor.cli._doctor import register as register_doctor
from proctor.cli._evidence import register as register_evidence
from proctor.cli._governance import register as register_governance
from proctor.cli._manifest import register as register_manifest
from proctor.cli._mcp import register as register_mcp
from proctor.cli._resources import bucket_app, dataset_app, policy_app, secret_app
from proctor.cli._retention import register as register_retention
from proctor.cli._sandbox import sandbox_app
from proctor.cli._witness import register as register_witness
from proctor.governance import Tenant
from proctor.runtime import DEFAULT_TRUST_DOMAIN, default_home, init_home

# typer 0.26 to 0.28 vendor click, and name a value by its Python type in --help
# (<str>, <path>); people read click's names: TEXT, PATH, INTEGER. The one place
# such a name is made; a type with a metavar of its own (choices) keeps it. typer
# 0.29 is not used: it adds <bool> after flags and costs every command 0.2 s
# (pyproject.toml). tests/e2e/test_cli_conventions.py fails if this stops holding.
_CLICK_NAMES = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "boolean": "BOOLEAN",
                "filename": "FILE", "datetime": "DATETIME"}  # fmt: skip


def _metavar(self: _click_types.ParamType, param: object, ctx: object) -> str | None:
    return _CLICK_NAMES.get(self.name, self.name.upper())


_click_types.ParamType.get_metavar = _metavar  # type: ignore[method-assign]
_typer_metavar = typer.core.TyperArgument.make_metavar


def _argument_metavar(self: typer.core.TyperArgument, ctx: object, *, usage: bool = False) -> str:
    # typer writes a required argument in a usage line as `{digest}:TEXT`; people read
    # click's `DIGEST`, `[DIGEST]` when optional, `DIGEST...` when it takes several.
    if not usage:
        return str(_typer_metavar(self, ctx, usage=usage))  # type: ignore[arg-type]
    var = self.metavar or (self.name or "").upper()
    if var.startswith("["):
        return var
    if self.nargs != 1 and not var.endswith("..."):
        var += "..."
    return var if self.required else f"[{var}]"


typer.core.TyperArgument.make_metavar = _argument_metavar  # type: ignore[method-assign]
_typer_main = typer.core._main


def _main(self: object, **kwargs: Any) -> Any:
    # typer draws a usage error (--limit 0, an unknown option, a missing -o) as a boxed
    # panel under the usage line; every other error is one `error:` line and a hint.
    # Without rich markup here typer calls the exception's show() instead, which is
    # ours (below); help keeps its panels (the command's own rich_markup_mode).
    kwargs["rich_markup_mode"] = None
    return _typer_main(self, **kwargs)  # type: ignore[arg-type]


def _show_usage_error(self: _click_exceptions.ClickException, file: object = None) -> None:
    if isinstance(self, _click_exceptions.NoArgsIsHelpError):
        return  # the group printed its help already, as a bare `proctor audit` asks
    message = " ".join(self.format_message().split()).rstrip(".")
    ctx = getattr(self, "ctx", None)
    hint = None
    if ctx is not None:
        usage = " ".join(ctx.get_usage().split())
        usage = usage[:1].lower() + usage[1:]
        hint = f"{usage}; see {ctx.command_path} --help"
    _print_error(message[:1].lower() + message[1:], hint)


typer.core._main = _main
for _cls in (_click_exceptions.ClickException, _click_exceptions.UsageError,
             _click_exceptions.NoArgsIsHelpError):  # fmt: skip
    _cls.show = _show_usage_error  # type: ignore[method-assign]

app = typer.Typer(
    name="proctor",
    help="Proctor: run code on real data under policy, and prove what it did.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
tenant_app = typer.Typer(
    help="Tenants: the boundary of data, policy and logs.", no_args_is_help=True
)
key_app = typer.Typer(help="The runtime's checkpoint signing key.", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
app.add_typer(key_app, name="key")
app.add_typer(audit_app, name="audit")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(policy_app, name="policy")
app.add_typer(dataset_app, name="dataset")
app.add_typer(secret_app, name="secret")
app.add_typer(bucket_app, name="bucket")
app.add_typer(artifact_app, name="artifact")
register_governance(app, tenant_app)
register_evidence(app)
register_witness(app)
register_retention(app)
register_doctor(app)
register_backup(app)
register_ask(app)
register_manifest(app)
register_mcp(app)


def _print_version(value: bool) -> None:
    if value:
        console.print(__version__)
        raise typer.Exit()


@app.callback()
def root(
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            envvar="PROCTOR_SERVER",
            help="Work through a Proctor API at this URL (with --token) instead of a local home",
        ),
    ] = None,
    server_ca: Annotated[
        Path | None, typer.Option(help="CA bundle to verify the server's TLS certificate")
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_print_version,
            help="Print Proctor's version and exit",
        ),
    ] = False,
) -> None:
    """Proctor: run code on real data under policy, and prove what it did."""
    REMOTE["url"] = server
    REMOTE["ca"] = str(server_ca) if server_ca else None


@app.command()
def version(as_json: JsonOpt = False) -> None:
    """Print Proctor's version."""
    if as_json:
        emit_json({"version": __version__})
        return
    console.print(__version__)


@app.command()
def init(
    home: HomeOpt = None,
    trust_domain: Annotated[
        str, typer.Option(help="Trust domain for identities and log origins")
    ] = DEFAULT_TRUST_DOMAIN,
    store: Annotated[
        str | None,
        typer.Option(
            envvar="PROCTOR_STORE",
            help="postgresql://… (an existing database several nodes share) [default: SQLite]",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a Proctor home: store, signing key, system log."""
    target = home or default_home()
    config = init_home(target, trust_domain, store)
    with open_runtime(target) as rt:
        vkey = rt.ledger.vkey()
    if as_json:
        emit_json({"home": str(target), "trust_domain": config.trust_domain, "vkey": vkey})
        return
    console.print(f"initialised [bold]{target}[/] (trust domain {config.trust_domain})")
    console.print(f"verifier key: {vkey}")


def _tenant_json(t: Tenant, events: int) -> dict[str, object]:
    return {"name": t.name, "status": t.status, "created_at": t.created_at,
            "created_by": t.created_by, "events": events}  # fmt: skip


@tenant_app.command("create")
def tenant_create(
    name: Annotated[str, typer.Argument(help="The tenant's name (lowercase, digits, '-')")],
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Create a tenant and its audit log."""
    with open_runtime(home) as rt:
        tenant = rt.tenants.create(name, rt.operator)
        origin = rt.ledger.origin(tenant.name)
        size = rt.ledger.head(tenant.name).size
    if as_json:
        emit_json({**_tenant_json(tenant, size), "origin": origin})
        return
    console.print(f"created tenant [bold]{tenant.name}[/] (log {origin})")


@tenant_app.command("list")
def tenant_list(as_json: JsonOpt = False, wide: WideOpt = False, home: HomeOpt = None) -> None:
    """List tenants."""
    with open_runtime(home) as rt:
        tenants = rt.tenants.list()
        sizes = {t.name: rt.ledger.head(t.name).size for t in tenants}
    if as_json:
        emit_json([_tenant_json(t, sizes[t.name]) for t in tenants])
        return
    table = make_table("tenant", "status", "events", "created", "by", ids=("tenant",))
    for t in tenants:
        table.add_row(t.name, t.status, str(sizes[t.name]), t.created_at, t.created_by)
    print_table(table, wide)


@key_app.command("show")
def key_show(
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant",
            "-t",
            help="The line named for this log's origin ('system' for the runtime's log), "
            "as standard tlog tools expect [default: the runtime's line, which verifies "
            "every log]",
        ),
    ] = None,
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Print the verifier key line (C2SP signed-note vkey). One Ed25519 key signs every
    log's checkpoints, under the runtime's name and under the log's origin."""
    with open_runtime(home) as rt:
        log = rt.log_name(tenant) if tenant is not None else None
        vkey = rt.ledger.vkey(log)
        origin = rt.ledger.origin(log) if log is not None else None
    if as_json:
        emit_json({"vkey": vkey, **({"tenant": tenant, "origin": origin} if log else {})})
        return
    console.print(vkey, soft_wrap=True)


@app.command()
def demo(
    home: Annotated[
        Path | None,
        typer.Option(
            "--home",
            help="Home for the demo, a new or empty directory; every file the demo writes "
            "stays inside it [default: a new temp dir]",
        ),
    ] = None,
    replace: Annotated[
        bool,
        typer.Option("--replace", help="Delete an earlier demo's home at --home and start again"),
    ] = False,
) -> None:
    """Run the main job end to end and print the story."""
    from proctor.cli._demo import run_demo

    run_demo(home, replace)


def for_command(args: list[str]) -> typer.Typer:
    """The command line, holding only the command that ``args`` start with when they
    start with one (``tenant list ...``, ``run ...``): Typer builds the Click
    parameters of every command it holds at each start, about a fifth of a command's
    start-up time for the hundred-odd commands here, and a process runs one. Anything
    else (``--help``, a root option first, a misspelt command) gets the whole app, so
    help and errors are the same as ever."""
    import copy

    from typer.main import get_command_name

    name = args[0] if args else ""
    if not name or name.startswith("-"):
        return app
    groups = [g for g in app.registered_groups if g.typer_instance is not None
              and (g.name or g.typer_instance.info.name) == name]  # fmt: skip
    commands = [c for c in app.registered_commands if c.callback is not None
                and (c.name or get_command_name(c.callback.__name__)) == name]  # fmt: skip
    if not groups and not commands:
        return app
    one = copy.copy(app)
    one.registered_groups, one.registered_commands = groups, commands
    return one
