"""Texts written for a model: the server's instructions and the manifest format
(from docs/artifacts.md, kept to what an agent writing a manifest needs)."""

from __future__ import annotations

INSTRUCTIONS = """\
Proctor runs code against real customer data under a person's approval, and records \
every step in a tamper-evident ledger. You act as an agent principal of one tenant: \
everything you do is decided by the tenant's role policy and recorded with your identity.

The loop: describe_datasets (what data exists: tables, columns, types, never rows) -> \
describe_manifest_format -> submit_artifact (your files and a proctor.toml manifest; \
you get a digest) -> run_in_sandbox (the digest runs against synthetic twins of the \
data) -> show_run (output, calls, and each refusal with its ledger seq and reason) -> \
fix the code or the manifest and submit again -> request_approval -> approval_state. \
A person approves and a person deploys to production; you may then start runs of \
that deployment with run_deployment and read them with show_run.

You can never approve, deploy to production, answer an asked call, or act in another \
tenant: no tool does it, and the API refuses your token if you try another way."""

MANIFEST_FORMAT = """\
# proctor.toml: the manifest of an artifact

An artifact is your code plus a manifest, proctor.toml, at its root. The manifest names \
the program to start, the purpose of the processing, and every capability the code \
needs. Nothing is allowed that it does not name: a call outside it is refused and \
recorded, and the refusal's reason says what was missing. The artifact's id is a \
SHA-256 digest of its files and manifest: an approval covers exactly that code and \
those capabilities, and any changed byte is a new digest that needs approval again.

## Example

```toml
[artifact]
name = "churn-report"                  # 1-64 of a-z 0-9 . _ -
entrypoint = ["python3", "main.py"]    # argv, started in /code (the artifact), no shell
purpose = "Monthly churn report for the retention team"

[datasets.crm.tables.customers]        # dataset crm, table customers
columns = ["id", "country", "plan", "mrr"]
access = "read"                        # read | write | read-write (default read)

[egress]
hosts = ["enrich.example.com:443"]     # host, host:port, *.domain; no port means 443

[secrets]
names = ["enrich_token"]               # injected by the broker; the code never sees them

[buckets]
reports = "write"                      # read | write | read-write

[ask]                                  # calls that wait for a person's answer at run time
egress = ["enrich.example.com:443"]    # every call to these hosts (each one of egress.hosts)
buckets = ["reports"]                  # every write to these buckets (written by the manifest)
timeout = "5m"                         # unanswered this long: refused (default 5m, at most 24h)

[limits]
memory = "256M"
timeout = "60s"

[lifecycle]
mode = "job"                           # job | service | schedule
```

Only [artifact] with name, entrypoint and purpose is required. A manifest with no \
capabilities asks for nothing: the code can reach nothing outside its sandbox.

## Rules

- entrypoint is argv, not a shell line (["python3", "main.py"], never "python3 main.py"). \
For an interpreter (python3, sh, bash, node, ...) the script it starts must be one of \
the artifact's files.
- purpose: non-empty, at most 2000 characters; approvers and the evidence read it.
- datasets.<ds>.tables.<t>.columns: every column your statements touch, including those \
in WHERE, JOIN and ORDER BY; there is no "all columns". access: read = SELECT, \
write = INSERT/UPDATE/DELETE; an UPDATE ... WHERE reads the columns it filters on and \
needs read-write.
- Dataset, secret and bucket names: a lowercase letter, then up to 62 of a-z 0-9 _.
- Unknown keys, wrong types and empty arrays are refused at submission, each with a \
message naming the key.
- limits (all optional): memory, output (sizes: 65536, "64K", "256M", "1G"), timeout \
(durations: 90, "500ms", "60s", "5m", "1h"), pids, cpu, calls, calls_per_second, call_burst.
- lifecycle.every (schedules only, at least 1s), lifecycle.restart (services only: \
always | on-failure | never).
- [ask] marks risky capabilities (a host, a bucket write, a table write: \
ask.tables = ["dataset.table"] for tables with write access) whose every use waits for \
a person's answer while the run waits; a denied or unanswered call is refused. Each \
entry must be a capability the manifest already has. asked_calls lists them.

## In the code

Inside the sandbox the Python module proctor_guest reaches the data: \
proctor_guest.sql("crm", "SELECT id, country FROM customers") returns {"rows": [...]}; \
a refused call raises proctor_guest.Denied with .seq (the ledger event) and .reason. \
HTTP(S) to the hosts in [egress] goes through the broker's proxy (already set in the \
environment). In the sandbox environment the datasets are synthetic twins and the \
secrets test twins: the same names, no real data.

## Learning the manifest

Start narrow, run in the sandbox, and read the refusals with show_run; suggest_manifest \
(when available) turns a sandbox run's calls and refusals into the least-privilege \
manifest that would have allowed exactly them."""
