"""Issue 33, the second newcomer's trial: the frictions of runs, approvals and
``serve``, each tried again through the real CLI in a subprocess (and through the
API, ``--server``, where the item has a route).

The runs and approvals are the demo's (``demo_home``, a real ``proctor demo``), in
a copy per module; ``serve`` runs for real, on loopback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PROCTOR, CliResult, copy_home, run_cli, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_error(res: CliResult, *needles: str) -> None:
    """One ``error:`` line (and at most a hint), naming what it must; no traceback,
    no JSON log line."""
    lines = res.err.strip().splitlines()
    assert res.code == 2, (res.code, res.out, res.err)
    assert lines[0].startswith("error: "), res.err
    assert len(lines) <= 2 and all(not line.startswith("{") for line in lines), res.err
    assert (len(lines) == 1 or lines[1].startswith("hint: ")) and "Traceback" not in res.err
    for needle in needles:
        assert needle in lines[0], (needle, res.err)


# -- item 8: an unknown tenant is an error, not an empty answer ------------------------

LISTINGS = (
    ("runs", "list"),
    ("runs", "show", "r-0000"),
    ("principal", "list"),
    ("approval", "list"),
    ("approval", "show", "apr_0000"),
    ("deployment", "list"),
    ("deployment", "versions", "job"),
    ("quorum", "show"),
    ("egress", "sandbox-hosts"),
    ("egress", "ca", "list"),
    ("history", "--at", "now"),
)


def test_listing_an_unknown_tenant_says_so_and_fails(home: Path) -> None:
    for args in LISTINGS:
        res = run_cli(*args, "-t", "nope", home=home, check=False)
        _one_error(res, "unknown tenant 'nope'")
        assert res.out == "", (args, res.out)  # not an empty table
    res = run_cli("tenant", "quota", "nope", home=home, check=False)
    _one_error(res, "unknown tenant 'nope'")


# -- item 3: serve's TLS options -----------------------------------------------------


def _pem_pair(d: Path, name: str) -> tuple[Path, Path]:
    from datetime import UTC, datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1)).not_valid_after(now + timedelta(days=1))
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = d / f"{name}.crt", d / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))  # fmt: skip
    return cert_path, key_path


def test_serve_names_the_tls_file_it_cannot_use_in_one_line(home: Path, tmp_path: Path) -> None:
    cert, key = _pem_pair(tmp_path, "a")
    _, other_key = _pem_pair(tmp_path, "b")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    port = str(_free_port())
    cases = (
        (("--tls-cert", "/nope/cert.pem", "--tls-key", str(key)),
         ("/nope/cert.pem", "cannot read the TLS certificate")),
        (("--tls-cert", str(cert), "--tls-key", "/nope/key.pem"),
         ("/nope/key.pem", "cannot read the TLS key")),
        (("--tls-cert", str(junk), "--tls-key", str(key)),
         (str(junk), "is not a PEM certificate")),
        (("--tls-cert", str(cert), "--tls-key", str(junk)),
         (str(junk), "is not a PEM private key")),
        (("--tls-cert", str(cert), "--tls-key", str(other_key)),
         (str(other_key), str(cert), "is not the key of the certificate")),
        (("--tls-cert", str(cert)), ("TLS needs both a certificate and its key",)),
    )  # fmt: skip
    for args, needles in cases:
        res = run_cli("serve", "--api-port", port, *args, home=home, check=False)
        _one_error(res, *needles)
        assert "PEM lib" not in res.err and res.out == ""
    # Nothing was started: no node joined the store (before, a certificate that failed
    # after the node joined left it registered until its lease lapsed).
    assert json.loads(run_cli("nodes", "--json", home=home).out) == []


def test_serve_refuses_the_apis_options_without_an_api(home: Path, tmp_path: Path) -> None:
    cert, key = _pem_pair(tmp_path, "a")
    res = run_cli("serve", "--no-api", "--tls-cert", str(cert), "--tls-key", str(key),
                  home=home, check=False)  # fmt: skip
    _one_error(res, "--tls-cert, --tls-key are for the HTTP API", "--no-api")
    res = run_cli("serve", "--no-api", "--public-log", "acme", home=home, check=False)
    _one_error(res, "--public-log is for the HTTP API")
    assert json.loads(run_cli("nodes", "--json", home=home).out) == []


def test_the_library_names_the_file_too(tmp_path: Path) -> None:
    """``serve_api`` (what ``serve`` and embedders call) checks the same way."""
    from proctor.api import check_tls
    from proctor.errors import UsageError

    cert, key = _pem_pair(tmp_path, "a")
    assert check_tls(cert, key).verify_mode.name == "CERT_NONE"
    with pytest.raises(UsageError, match=re.escape(f"{key} is not a PEM certificate")):
        check_tls(key, key)


# -- item 14: serve logs its stop -------------------------------------------------------


def _documented_events() -> set[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    return set(re.findall(r"^\| `([a-z_.]+)` \|", text, re.MULTILINE))


@pytest.mark.host
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_logs_when_it_begins_stopping_and_when_it_has_stopped(
    home: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    log = tmp_path / "serve.stderr"
    env = dict(os.environ, PROCTOR_HOME=str(home))
    with log.open("wb") as err:
        serve = subprocess.Popen([PROCTOR, "serve", "--api-port", str(_free_port())], env=env,
                                 stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    try:
        wait_until(lambda: b'"node.join"' in log.read_bytes(), "serve to start")
        serve.send_signal(signum)
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    events = [line["event"] for line in lines]
    assert "serve.stopping" in events and events[-1] == "serve.stopped", events
    assert events.index("serve.stopping") < events.index("serve.stopped")
    stopping = lines[events.index("serve.stopping")]
    assert stopping["signal"] == signum.name and stopping["reason"] == f"signal {signum.name}"
    assert lines[-1]["signal"] == signum.name and lines[-1]["unfinished"] == []
    assert stopping["node"] == lines[-1]["node"] == lines[0]["node"]
    # Every event serve wrote is in the operator's list (docs/operations.md).
    assert set(events) <= _documented_events(), set(events) - _documented_events()


# -- the demo's runs: items 12, 16, 17 ------------------------------------------------------


@dataclass
class Acme:
    home: Path
    url: str
    tokens: dict[str, str]
    operator_run: str
    run_err: str

    def cli(self, *args: str, check: bool = True) -> CliResult:
        return run_cli(*args, home=self.home, check=check)

    def remote(self, *args: str, who: str = "dev", check: bool = True) -> CliResult:
        return run_cli("--server", self.url, *args, "--token", self.tokens[who],
                       home=self.home, check=check)  # fmt: skip


@pytest.fixture(scope="module")
def acme(demo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Acme]:
    home = copy_home(demo_home, tmp_path_factory.mktemp("newcomer") / "home")
    # The demo's runs were started by acme/dev; one more, by the local operator.
    ran = run_cli("run", "churn", "-t", "acme", home=home)
    operator_run = re.findall(r"^run (r-[0-9a-f]+):", ran.err, re.MULTILINE)[-1]
    tokens = {who: run_cli("principal", "rotate", "-t", "acme", who, home=home).out.strip()
              for who in ("dev", "alice")}  # fmt: skip
    port = _free_port()
    env = dict(os.environ, PROCTOR_HOME=str(home))
    serve = subprocess.Popen([PROCTOR, "serve", "--api-port", str(port)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        from proctor import Client

        def up() -> bool:
            try:
                Client(url, tokens["dev"]).health()
            except Exception:
                return False
            return True

        wait_until(up, "the API")
        yield Acme(home, url, tokens, operator_run, ran.err)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


def test_run_says_its_end_once(acme: Acme) -> None:
    """Item 16: ``run r-…: succeeded (exit, exit 0)`` said "exit" twice."""
    (line,) = [x for x in acme.run_err.splitlines() if x.startswith("run r-")]
    assert line == f"run {acme.operator_run}: succeeded (exit 0)"


def test_a_short_run_prefix_is_ambiguous_with_its_count(acme: Acme) -> None:
    """Item 12: ``runs show r-`` said "no run 'r-'"; docs/cli.md promises the count."""
    runs = json.loads(acme.cli("runs", "list", "-t", "acme", "--json").out)
    assert len(runs) == 3
    for res in (acme.cli("runs", "show", "r-", "-t", "acme", check=False),
                acme.remote("runs", "show", "r-", "-t", "acme", check=False)):  # fmt: skip
        _one_error(res, "'r-' is ambiguous: 3 run ids in tenant 'acme'")
        assert "at least 4 characters" in res.err
    # A prefix that matches nothing is still "not found", and a unique one still works.
    _one_error(acme.cli("runs", "show", "r-z", "-t", "acme", check=False), "no run 'r-z'")
    shown = json.loads(acme.cli("runs", "show", acme.operator_run[:8], "-t", "acme",
                                "--json").out)  # fmt: skip
    assert shown["id"] == acme.operator_run


def _ids(res: CliResult) -> list[str]:
    return [r["id"] for r in json.loads(res.out)]


def test_runs_list_filters_by_status_time_and_who_started_them(acme: Acme) -> None:
    """Item 17: --status, --since (relative and ISO) and --mine, locally and through
    the API."""
    every = _ids(acme.cli("runs", "list", "-t", "acme", "--json"))
    by_dev = [r for r in every if r != acme.operator_run]
    started = {
        r["id"]: r["started_at"]
        for r in json.loads(acme.cli("runs", "list", "-t", "acme", "--json").out)
    }
    for how in (acme.cli, acme.remote):

        def listed(*args: str, how: Any = how) -> list[str]:
            return _ids(how("runs", "list", "-t", "acme", "--json", *args))

        assert listed("--since", started[every[1]]) == every[1:]  # an ISO time, inclusive
        assert listed("--status", "succeeded", "--since", "1h", "--deployment", "churn") == [
            r for r in every if r != every[0]
        ]
        if how is acme.remote:
            continue  # the API's filters are the library's: the rest once, locally
        assert listed("--status", "succeeded") == every
        assert listed("--status", "failed") == []
        # Each spelling is parsed by test_relative_times_parse_against_one_now.
        assert listed("--since", "yesterday") == every
        assert listed("--since", "0s") == []  # now: every run started before it
        assert listed("--since", "2100-01-01") == []
    # --mine: the runs the acting principal started, from their signed run.start events.
    assert _ids(acme.cli("runs", "list", "-t", "acme", "--json", "--mine")) == [acme.operator_run]
    mine = ("runs", "list", "-t", "acme", "--json", "--mine")
    assert _ids(acme.cli(*mine, "--token", acme.tokens["dev"])) == by_dev
    assert _ids(acme.remote(*mine)) == by_dev
    assert _ids(acme.remote(*mine, "--since", "0s")) == []
    # A table for people too, filtered the same.
    table = acme.cli("runs", "list", "-t", "acme", "--mine").out
    assert acme.operator_run in table and not any(r in table for r in by_dev)
    # Bad input: one line naming the option.
    _one_error(acme.cli("runs", "list", "-t", "acme", "--since", "tomorrow", check=False),
               "--since: 'tomorrow' is not a time")  # fmt: skip
    _one_error(acme.cli("runs", "list", "-t", "acme", "--status", "ok", check=False),
               "--status: 'ok' is not a run status")  # fmt: skip
    # An unknown tenant through the API says so too (item 8).
    _one_error(acme.remote("runs", "list", "-t", "nope", check=False), "unknown tenant 'nope'")


def test_relative_times_parse_against_one_now() -> None:
    from datetime import UTC, datetime

    from proctor.cli._when import parse_when
    from proctor.errors import UsageError

    now = datetime(2026, 12, 5, 8, 30, 15, 123456, tzinfo=UTC)
    cases = {
        "30m": "2026-12-05T08:00:15.123456Z", "1h": "2026-12-05T07:30:15.123456Z",
        "2d": "2026-12-03T08:30:15.123456Z", "1w": "2026-11-28T08:30:15.123456Z",
        "1.5h": "2026-12-05T07:00:15.123456Z", "2h ago": "2026-12-05T06:30:15.123456Z",
        "90s": "2026-12-05T08:28:45.123456Z", "now": "2026-12-05T08:30:15.123456Z",
        "today": "2026-12-05T00:00:00.000000Z", "Yesterday": "2026-12-04T00:00:00.000000Z",
        "2026-12-01": "2026-12-01T00:00:00.000000Z",
        "2026-12-01T09:00:00Z": "2026-12-01T09:00:00.000000Z",
        "2026-12-01T10:00:00+01:00": "2026-12-01T09:00:00.000000Z",
    }  # fmt: skip
    for text, want in cases.items():
        assert parse_when(text, "--since", now=now) == want, text
    assert parse_when(None, "--since") is None
    for bad in ("30x", "", "-1h", "tomorrow", "1000000d", "0001-01-01T00:00+01:00"):
        with pytest.raises(UsageError, match="--since: "):
            parse_when(bad, "--since", now=now)


# -- item 11: what was approved before ----------------------------------------------------


def test_approve_and_approval_show_name_the_approved_predecessor_and_its_diff(
    acme: Acme, tmp_path: Path
) -> None:
    (old,) = {a["digest"] for a in json.loads(acme.cli("approval", "list", "-t", "acme",
                                                       "--json").out)}  # fmt: skip
    source = tmp_path / "churn-report"
    subprocess.run(["cp", "-r", str(ROOT / "examples" / "churn-report"), str(source)], check=True)
    with (source / "main.py").open("a") as f:
        f.write("# the second version\n")
    new = json.loads(acme.cli("artifact", "submit", "-t", "acme", str(source), "--json",
                              "--token", acme.tokens["dev"]).out)["digest"]  # fmt: skip
    diff = f"proctor artifact diff -t acme {old} {new}"
    # Through the API, as an approver: the new version is named as following the old.
    res = acme.remote("approve", new, "-t", "acme", "--yes", who="alice")
    assert f"follows the approved churn-report {old}" in res.out, res.out
    assert diff in res.out
    approval = json.loads(acme.remote("approval", "list", "-t", "acme", "--digest", new,
                                      "--json", who="alice").out)[-1]  # fmt: skip
    # approval show: the purpose and the capabilities approved, and the predecessor.
    shown = acme.cli("approval", "show", approval["id"], "-t", "acme").out
    assert "purpose:     Monthly churn-risk report" in shown, shown
    assert "  - read of crm.customers (columns country, id, mrr, plan)" in shown
    assert f"follows the approved churn-report {old}" in shown and diff in shown
    for doc in (json.loads(acme.cli("approval", "show", approval["id"][:10], "-t", "acme",
                                    "--json").out),
                json.loads(acme.remote("approval", "show", approval["id"][:10], "-t", "acme",
                                       "--json", who="alice").out)):  # fmt: skip
        assert doc["id"] == approval["id"] and doc["artifact"] == "churn-report"
        assert doc["purpose"].startswith("Monthly churn-risk report")
        assert "write of bucket reports" in doc["capabilities_words"]
        assert doc["capabilities"]["buckets"]
        assert doc["approved_predecessor"]["digest"] == old
    # The command offered works, and shows the change.
    changed = acme.cli(*diff.split()[1:])
    assert "main.py" in changed.out and "the second version" in changed.out
    # The first version follows none.
    (first,) = [a for a in json.loads(acme.cli("approval", "list", "-t", "acme", "--json").out)
                if a["digest"] == old]  # fmt: skip
    alone = json.loads(acme.cli("approval", "show", first["id"], "-t", "acme", "--json").out)
    assert alone["approved_predecessor"] is None
    assert (
        "no other version of churn-report is approved"
        in acme.cli("approval", "show", first["id"], "-t", "acme").out
    )
