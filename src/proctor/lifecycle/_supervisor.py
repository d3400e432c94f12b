"""Runs: start a deployment's artifact in a sandbox whose only way out is the broker.

Every run start re-checks what made the deployment legitimate: the tenant is not
frozen, the deployment is active, and for production the artifact still has a
quorum of valid approvals (revoked or expired ones do not count). The run gets
its workload identity, the tenant's policy plus the permits its approved
capabilities imply, and only the datasets, secrets and buckets it was approved
for. ``run.start`` is durable before the sandbox starts and ``run.end`` records
how it ended; a run the ledger cannot record does not start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proctor import telemetry
from proctor.broker import (
    AskGate,
    AskRules,
    Broker,
    DatasetBinding,
    RateLimit,
    RunScope,
    SecretBinding,
    approved_rules,
    dataset_connector,
    rule_hosts,
)
from proctor.errors import ProctorError, RunRefused
from proctor.governance import (
    ApprovalRequired,
    Deployment,
    Home,
    RunRecord,
    Runs,
    RunStanding,
    bindings,
    effective_policies,
    is_production,
    policy_object,
    require_backed,
    requires_quorum,
)
from proctor.ledger import Action, Actor, EventDraft, clip, make_receipt, utc_now
from proctor.lifecycle._brokered import run_brokered
from proctor.lifecycle._jsonlog import log_event
from proctor.lifecycle._queue import RunQueue
from proctor.sandbox import (
    Limits,
    SandboxResult,
    get_driver,
    process_start_time,
)
from proctor.store import Conn

_log = logging.getLogger("proctor.lifecycle")

_SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
_WATCH_INTERVAL = 0.5


class Interrupt(threading.Event):
    """A run's ``cancel`` that says why: a run it stops ends 'interrupted' with that
    reason (``proctor run`` sets it on SIGINT, SIGTERM or SIGHUP), not 'stopped'."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None
        self.signum: int | None = None

    def interrupt(self, signum: int) -> None:
        if self.signum is None:  # the first signal is the one that counts
            self.signum = signum
            self.reason = signal.Signals(signum).name
        self.set()


class _RunStop(Interrupt):
    """One run's stop: set by its own watcher or by the supervisor shutting down,
    and set as well whenever the caller's ``cancel`` is (a signal, a slot of
    ``serve``). Only ``is_set`` is read while the sandbox runs."""

    def __init__(self, outer: threading.Event | None) -> None:
        super().__init__()
        self.outer = outer

    def is_set(self) -> bool:
        return super().is_set() or (self.outer is not None and self.outer.is_set())

    def stop(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.set()

    @property
    def why(self) -> str | None:
        """Why it ended as 'interrupted', if it did: the caller's signal first."""
        outer = self.outer
        if isinstance(outer, Interrupt) and outer.is_set() and outer.reason is not None:
            return outer.reason
        return self.reason


class _RunMetrics:
    """A run in ``proctor_runs{state, backend}`` (starting until its sandbox is asked
    for, then running) and, at its end, ``proctor_runs_finished_total``; and its span
    (``proctor.run``), whose context the broker's call spans join (by run id). The
    span's parent is the context current where the run starts: an API request's,
    carried into the run's thread, or none (a tick of serve: a trace of its own)."""

    __slots__ = ("_backend", "_run_id", "_span", "_state")

    def __init__(self, run_id: str, backend: str, attributes: dict[str, str]) -> None:
        self._run_id = run_id
        self._backend = backend
        self._state: str | None = "starting"
        telemetry.metrics().runs.labels("starting", backend).inc()
        self._span: Any = None
        if telemetry.tracing_enabled():
            from opentelemetry import trace

            self._span = telemetry.tracer().start_span(
                "proctor.run", kind=trace.SpanKind.INTERNAL, attributes=attributes
            )
            telemetry.bind_run(run_id, trace.set_span_in_context(self._span))

    def running(self) -> None:
        runs = telemetry.metrics().runs
        if self._state == "starting":
            runs.labels("starting", self._backend).dec()
            runs.labels("running", self._backend).inc()
            self._state = "running"

    def end(self, outcome: str | None) -> None:
        """The run ended as ``outcome`` (None: refused before it started)."""
        m = telemetry.metrics()
        if self._state is not None:
            m.runs.labels(self._state, self._backend).dec()
            self._state = None
        if outcome is not None:
            m.runs_finished.labels(outcome, self._backend).inc()
        if self._span is not None:
            from opentelemetry import trace

            telemetry.unbind_run(self._run_id)
            self._span.set_attribute("proctor.outcome", outcome or "refused")
            if outcome in (None, "failed"):
                self._span.set_status(trace.StatusCode.ERROR)
            self._span.end()
            self._span = None


class AlreadyRunning(RunRefused):
    """A service or a schedule was started while a run of it is in progress."""


#: The reason a run ends with when the ``serve`` that owns it is told to stop.
SUPERVISOR_STOPPING = "supervisor stopping"


def _limits(manifest_limits: Any) -> Limits:
    base = Limits()
    return Limits(
        memory_bytes=manifest_limits.memory_bytes or base.memory_bytes,
        pids=manifest_limits.pids or base.pids,
        cpu=manifest_limits.cpu or base.cpu,
        wall_seconds=manifest_limits.wall_seconds or base.wall_seconds,
        output_bytes=manifest_limits.output_bytes or base.output_bytes,
    )


class Supervisor:
    """Starts runs; ``serve`` (see _serve.py) keeps services and schedules going."""

    def __init__(self, rt: Home, broker: Broker, backend: str | None = None) -> None:
        self.rt = rt
        self.broker = broker
        self.driver = get_driver(backend)
        self.runs = Runs(rt)
        # host:pid:start time: a pid the kernel reuses after our death does not
        # keep our runs 'running' (see mark_interrupted).
        pid = os.getpid()
        self.supervisor_id = f"{os.uname().nodename}:{pid}:{process_start_time(pid)}"
        # The runs this supervisor has in progress, whoever asked (serve's slots, the
        # API, the CLI), so that shutting down stops every one of them.
        self._active: dict[str, _RunStop] = {}
        self._lock = threading.Lock()
        self._closing: str | None = None
        self._idle = threading.Condition(self._lock)
        #: The run queue of the serve node this supervisor belongs to (set by serve):
        #: the API hands it the runs asked of it when other nodes are live.
        self.queue: RunQueue | None = None

    def shutdown(self, reason: str = SUPERVISOR_STOPPING, timeout: float = 60.0) -> list[str]:
        """Refuse new runs, stop every run in progress, and wait for each to be
        recorded (``run.end``, interrupted with ``reason``) and its sandbox removed.
        Returns the ids of runs still not finished after ``timeout`` seconds."""
        with self._lock:
            self._closing = self._closing or reason
            for stop in self._active.values():
                stop.stop(reason)
            self._idle.wait_for(lambda: not self._active, timeout)
            return sorted(self._active)

    def _ca_dir(self, tenant: str, run_id: str, pem: bytes) -> Path:
        # One bundle per run: each run's CA certificate names its own secrets' hosts.
        directory = self.rt.home / "ca-bundles" / tenant / run_id
        directory.mkdir(parents=True, exist_ok=True, mode=0o755)
        system = _SYSTEM_BUNDLE.read_bytes() if _SYSTEM_BUNDLE.exists() else b""
        bundle = directory / "bundle.pem"
        tmp = directory / "bundle.pem.tmp"
        tmp.write_bytes(system + b"\n" + pem)
        tmp.chmod(0o644)
        tmp.replace(bundle)
        return directory

    def _refuse(self, tenant: str, actor: Actor, deployment: str, reason: str,
                artifact: str | None = None,
                error: type[RunRefused] = RunRefused) -> RunRefused:  # fmt: skip
        self.rt.ledger.append(
            tenant,
            EventDraft(actor, Action.RUN_START, f"deployment/{deployment}", decision="deny",
                       reason=reason, deployment=deployment, artifact=artifact),
        )  # fmt: skip
        return error(f"run of {deployment} refused: {reason}")

    def check_startable(
        self, tenant: str, name: str, actor: Actor
    ) -> tuple[Deployment, Any, tuple[str, ...]]:
        rt = self.rt
        t = rt.tenants.get(tenant)
        if t.status == "frozen":
            raise self._refuse(tenant, actor, name, "the tenant is frozen")
        dep = rt.deployments.get(tenant, name)
        if dep.status != "active":
            raise self._refuse(tenant, actor, name, f"the deployment is {dep.status}")
        artifact = rt.artifacts.get(tenant, dep.digest)
        try:
            # The stored deployment still asks for what the manifest says, and a sandbox
            # one holds no production name (a store row changed by hand included).
            rt.deployments.lifecycle(artifact, dep.mode, dep.every_seconds)
            rt.deployments.check_name(tenant, name, dep.environment)
            # What would run is what the signed record says was submitted and deployed:
            # the digest recomputed from the stored files and manifest, the submit and
            # deployment events (a store changed without the key is refused here).
            require_backed(rt.store, rt.ledger, rt.artifacts, dep)
        except ProctorError as exc:
            raise self._refuse(tenant, actor, name, exc.message, dep.digest) from exc
        approvals: tuple[str, ...] = ()
        if requires_quorum(dep.environment):
            try:
                approvals = tuple(a.id for a in rt.approvals.require_quorum(tenant, artifact))
            except ApprovalRequired as exc:
                raise self._refuse(tenant, actor, name, exc.message, dep.digest) from exc
        else:
            rt.deployments.check_synthetic(tenant, artifact)
        if dep.mode != "job" and (running := self.runs.running_one(tenant, name)) is not None:
            # Answered early (the API's stream has not started); the store decides a race.
            raise self._refuse(
                tenant, actor, name,
                f"deployment {name} is running already ({running}); a service or a schedule"
                " has one run at a time",
                dep.digest, AlreadyRunning,
            )  # fmt: skip
        return dep, artifact, approvals

    def start(
        self,
        tenant: str,
        name: str,
        actor: Actor,
        *,
        on_stdout: Callable[[bytes], object] | None = None,
        on_stderr: Callable[[bytes], object] | None = None,
        cancel: threading.Event | None = None,
        attempt: int = 1,
        env: dict[str, str] | None = None,
        on_start: Callable[[str], object] | None = None,
    ) -> RunRecord:
        with self._lock:
            if self._closing is not None:
                raise RunRefused(
                    f"run of {name} refused: this supervisor is shutting down ({self._closing})"
                )
        dep, artifact, approvals = self.check_startable(tenant, name, actor)
        run_id = "r-" + os.urandom(6).hex()
        stop = _RunStop(cancel)
        scope, limits, limits_doc = self._scope(tenant, dep, artifact, approvals, run_id)
        # Held to the store at every call, in the call's own transaction: a freeze,
        # stop or revocation by any process is seen by the next call.
        required = 0
        if requires_quorum(dep.environment):
            required = self.rt.approvals.quorum(tenant).required
        scope.standing = RunStanding(
            tenant, name, dep.digest, approvals, required, stopped=stop.is_set
        )
        with self._lock:
            if self._closing is not None:
                raise RunRefused(f"run of {name} refused: this supervisor is shutting down")
            self._active[run_id] = stop
        watched: _RunMetrics | None = None
        outcome: str | None = None
        try:
            watched = _RunMetrics(run_id, self.driver.name, {
                "proctor.tenant": tenant, "proctor.deployment": name, "proctor.run": run_id,
                "proctor.artifact.digest": dep.digest, "proctor.environment": dep.environment,
                "proctor.backend": self.driver.name,
            })  # fmt: skip
            try:
                self._record_start(actor, scope, dep, artifact, limits_doc, attempt)
            except RunRefused as exc:  # running already: the refusal is recorded
                raise self._refuse(
                    tenant, actor, name, exc.message, dep.digest, AlreadyRunning
                ) from None
            run_log: dict[str, Any] = {
                "tenant": tenant, "deployment": name, "run": run_id, "digest": dep.digest,
                "environment": dep.environment, "attempt": attempt, "actor": actor.id,
            }  # fmt: skip
            log_event(_log, Action.RUN_START, **run_log)
            if on_start is not None:
                on_start(run_id)  # run.start is durable: whoever waits may follow it
            result, failure, output = self._run_sandbox(
                scope, dep, artifact, limits, env, on_stdout, on_stderr, stop, watched.running
            )
            record = self._finish(tenant, run_id, actor, dep, result, failure, output, stop,
                                  scope)  # fmt: skip
            outcome = record.status
            log_event(_log, Action.RUN_END, **run_log, outcome=record.status,
                      reason=record.reason, exit_code=record.exit_code)  # fmt: skip
            return record
        finally:
            if watched is not None:
                watched.end(outcome)
            with self._lock:
                self._active.pop(run_id, None)
                self._idle.notify_all()

    def _scope(
        self, tenant: str, dep: Deployment, artifact: Any, approvals: tuple[str, ...], run_id: str
    ) -> tuple[RunScope, Limits, dict[str, Any]]:
        """What the broker knows of the run: its identity, policy and bindings."""
        rt, name, manifest = self.rt, dep.name, artifact.manifest
        workload = (
            f"spiffe://{rt.config.trust_domain}/tenant/{tenant}/deployment/{name}/run/{run_id}"
        )
        caps = manifest.capabilities
        # Every binding comes from the environment's one rule: in the sandbox only
        # stand-ins (synthetic twins, test secrets, sandbox buckets, sandbox hosts).
        env_bound = bindings(rt.resources, rt.subprocessors, tenant, dep.environment, caps)
        policies = effective_policies(rt.policies, tenant, name, caps, env_bound.forbid)
        datasets = {
            ds_name: DatasetBinding(ds_name, d.kind, d.location, d.synthetic)
            for ds_name, d in env_bound.datasets.items()
        }
        for ds_name, binding in datasets.items():
            # What the engine enforces itself of the approved columns (PostgreSQL: the
            # deployment's own role, reset to match at every start).
            dataset_connector(binding.kind).grant(
                binding, tenant, name, caps["datasets"][ds_name].get("tables", {})
            )
        # Bound under the name the code uses; in the sandbox the value is the twin's.
        secrets = {
            used: SecretBinding(
                used, rt.resources.secret_value(tenant, s.name), s.hosts, s.header, s.template
            )
            for used, s in env_bound.secrets.items()
        }
        limits = _limits(manifest.limits)
        limits_doc: dict[str, Any] = {
            "memory_bytes": limits.memory_bytes, "pids": limits.pids, "cpu": str(limits.cpu),
            "wall_seconds": str(limits.wall_seconds), "output_bytes": limits.output_bytes,
        }  # fmt: skip
        # The manifest's call budget, else the broker's default when the run opens.
        rate_limit = None
        if manifest.limits.calls_per_second or manifest.limits.call_burst:
            base = RateLimit()
            rate_limit = RateLimit(manifest.limits.calls_per_second or base.per_second,
                                   manifest.limits.call_burst or base.burst)  # fmt: skip
            limits_doc["calls_per_second"] = str(rate_limit.per_second)
            limits_doc["call_burst"] = rate_limit.burst
        # The run's calls in all (the approved manifest's, else the broker's default).
        call_bound = manifest.limits.calls or self.broker.call_bound
        limits_doc["calls"] = call_bound
        scope = RunScope(
            tenant=tenant,
            run_id=run_id,
            workload=workload,
            deployment=name,
            artifact=dep.digest,
            approvals=approvals,
            environment=dep.environment,
            policies=policies,
            ledger=rt.ledger,
            datasets=datasets,
            secrets=secrets,
            buckets_dir=env_bound.buckets_dir,
            lineage_key=rt.keys.lineage_key(tenant),
            allowed_ranges=rt.egress.get(tenant),
            # The approved request rules of egress hosts (the broker ends their TLS).
            egress_rules=approved_rules(caps),
            rate_limit=rate_limit,
            call_bound=call_bound,
            # The tenant's events of the day, counted from its log in the store (so a
            # restarted serve counts what came before it) against its quota.
            ledger_quota=lambda: rt.tenants.ledger_day(tenant),
            quota_refused=lambda day, seq, reason: rt.tenants.ledger_quota_refused(
                tenant, day, seq, reason
            ),
        )
        # The calls that wait for a person's answer (the approved manifest's ``ask``).
        asked = AskRules.of(caps)
        if asked is not None:
            scope.asks = AskGate(asked, rt.store)
        return scope, limits, limits_doc

    def _record_start(
        self, actor: Actor, scope: RunScope, dep: Deployment, artifact: Any,
        limits_doc: dict[str, Any], attempt: int,
    ) -> None:  # fmt: skip
        """``run.start``, durable with the run's row, before anything runs."""
        tenant, run_id, approvals = scope.tenant, scope.run_id, scope.approvals
        started_at = utc_now()

        def insert(conn: Conn) -> None:
            # A service or a schedule: one run at a time, held by the store.
            Runs.insert(conn, (
                run_id, tenant, dep.name, dep.version, dep.digest, dep.environment,
                scope.workload, json.dumps(list(approvals)), self.driver.name, None, "running",
                None, None, attempt, json.dumps(limits_doc), None, started_at, None,
            ), self.supervisor_id, exclusive=dep.mode != "job")  # fmt: skip

        self.rt.ledger.append(
            tenant,
            EventDraft(
                actor, Action.RUN_START, f"run/{run_id}", reason="started", deployment=dep.name,
                run=run_id, artifact=dep.digest, approvals=approvals,
                details={
                    "workload": scope.workload, "environment": dep.environment,
                    "version": dep.version, "backend": self.driver.name,
                    "policy_version": scope.policies.version, "limits": limits_doc,
                    "attempt": attempt, "purpose": artifact.purpose,
                    "row_limit": scope.row_limit,
                },
                # The text the run's calls are decided under, named by the version they
                # cite: an evidence pack carries it and re-decides calls with it.
                objects=(policy_object(scope.policies),),
            ),
            hook=insert,
        )  # fmt: skip

    def _run_sandbox(
        self, scope: RunScope, dep: Deployment, artifact: Any, limits: Limits,
        env: dict[str, str] | None, on_stdout: Callable[[bytes], object] | None,
        on_stderr: Callable[[bytes], object] | None, cancel: threading.Event | None,
        on_running: Callable[[], None] = lambda: None,
    ) -> tuple[SandboxResult | None, str | None, str]:  # fmt: skip
        """The sandbox, from the code's copy to its removal: (result, failure, the
        output's digest). Whatever happens, nothing of the run is left but its logs."""
        rt, tenant, run_id = self.rt, scope.tenant, scope.run_id
        run_dir = rt.home / "runs" / run_id
        run_dir.mkdir(parents=True, mode=0o700)
        code = run_dir / "code"
        out_hash = hashlib.sha256()
        result: SandboxResult | None = None
        failure: str | None = None
        with (
            (run_dir / "stdout.log").open("wb") as out_log,
            (run_dir / "stderr.log").open("wb") as err_log,
        ):

            def to_out(data: bytes) -> None:
                out_hash.update(data)
                out_log.write(data)
                out_log.flush()
                if on_stdout is not None:
                    on_stdout(data)

            def to_err(data: bytes) -> None:
                err_log.write(data)
                err_log.flush()
                if on_stderr is not None:
                    on_stderr(data)

            stop = cancel or threading.Event()
            finished = threading.Event()
            watcher = threading.Thread(
                target=self._watch, args=(tenant, dep, artifact, stop, finished), daemon=True
            )
            ca_dir: Path | None = None
            try:
                watcher.start()
                rt.artifacts.materialize(tenant, dep.digest, code)
                if scope.secrets or scope.egress_rules:
                    # Constrained to this run's secrets' hosts and hosts with request rules
                    # (their TLS is ended by the broker): the CA vouches for no other name.
                    hosts = sorted({h for s in scope.secrets.values() for h in s.hosts}
                                   | set(rule_hosts(scope.egress_rules)))  # fmt: skip
                    ca_dir = self._ca_dir(tenant, run_id, rt.egress_ca_pem(tenant, hosts))
                on_running()
                result = run_brokered(
                    self.broker, scope, self.driver, tuple(artifact.manifest.entrypoint),
                    code_dir=code, limits=limits, ca_dir=ca_dir, env=env,
                    on_stdout=to_out, on_stderr=to_err, cancel=stop,
                )  # fmt: skip
            except ProctorError as exc:
                failure = exc.message
            except Exception as exc:  # the run must still be closed in the record
                failure = f"internal error: {type(exc).__name__}: {exc}"
            finally:
                finished.set()
                shutil.rmtree(code, ignore_errors=True)
                if ca_dir is not None:
                    shutil.rmtree(ca_dir, ignore_errors=True)
                for binding in scope.datasets.values():
                    dataset_connector(binding.kind).release(scope, binding)
        return result, failure, out_hash.hexdigest()

    def _watch(
        self,
        tenant: str,
        dep: Deployment,
        artifact: Any,
        stop: threading.Event,
        finished: threading.Event,
    ) -> None:
        """While a run lasts, stop it as soon as it loses its footing: the tenant is
        frozen, the deployment stopped, or (production) its quorum is gone."""
        while not finished.wait(_WATCH_INTERVAL) and not stop.is_set():
            try:
                frozen = self.rt.tenants.get(tenant).status == "frozen"
                if frozen or self.rt.deployments.get(tenant, dep.name).status == "stopped":
                    stop.set()
                elif requires_quorum(dep.environment):
                    self.rt.approvals.require_quorum(tenant, artifact)
            except ApprovalRequired:
                stop.set()
            except ProctorError:
                continue  # a store hiccup is not a reason to kill a run

    def broker_ca_pem(self, tenant: str) -> bytes:
        return self.rt.egress_ca_pem(tenant)

    def _finish(
        self, tenant: str, run_id: str, actor: Actor, dep: Deployment,
        result: SandboxResult | None, failure: str | None, output: str,
        cancel: threading.Event | None = None, scope: RunScope | None = None,
    ) -> RunRecord:  # fmt: skip
        event_reason: str | None = None
        if result is None:
            status, reason, code, platform = "failed", f"start failed: {failure}", None, None
        else:
            reason = result.reason.value
            code, platform = result.exit_code, result.platform
            if isinstance(cancel, _RunStop):
                why = cancel.why
            else:
                why = cancel.reason if isinstance(cancel, Interrupt) else None
            if result.reason.value == "stopped" and why is not None:
                # Stopped because its own process was told to end (a signal): the run
                # did not choose to stop, and was not stopped by governance.
                status, reason, event_reason = "interrupted", why, f"interrupted: {why}"
            elif result.reason.value == "stopped":
                status = "stopped"
            elif result.reason.value == "exit" and result.exit_code == 0:
                status = "succeeded"
            else:
                status = "failed"
        ended_at = utc_now()

        def update(conn: Conn) -> None:
            conn.execute(
                "UPDATE runs SET status = ?, reason = ?, exit_code = ?, platform = ?,"
                " output_digest = ?, ended_at = ? WHERE id = ?",
                (status, reason, code, platform, f"sha256:{output}", ended_at, run_id),
            )

        details: dict[str, Any] = {"status": status, "exit_code": code, "platform": platform,
                                   "output_digest": f"sha256:{output}"}  # fmt: skip
        if result is not None:
            details.update(
                duration_ms=round(result.duration_seconds * 1000),
                stdout_bytes=result.stdout_bytes,
                stderr_bytes=result.stderr_bytes,
                memory_peak_bytes=result.memory_peak_bytes,
            )
        if scope is not None:
            # What the run's one call_bound or ledger_quota event does not say: how many
            # calls it made, and how many were refused past the bound or the quota.
            details["calls"] = {
                "made": scope.calls, "bound": scope.call_bound,
                "refused_over_bound": scope.refused_over_bound,
                "refused_over_quota": scope.refused_over_quota,
            }  # fmt: skip
        # No call waits past its run: its pending asks are closed, each recorded, before
        # the run's end (the sandbox is gone, so is the call that waited).
        self.close_asks(tenant, run_id, f"the run ended ({status}: {clip(reason, 200)})")
        end = self.rt.ledger.append(
            tenant,
            # A start failure's text comes from the sandbox: cut to the event's budget.
            EventDraft(actor, Action.RUN_END, f"run/{run_id}",
                       reason=clip(event_reason or reason, 2048), deployment=dep.name,
                       run=run_id, artifact=dep.digest, details=details),
            hook=update,
        )  # fmt: skip
        if is_production(dep.environment):
            # A signed receipt for the run's final event (C2SP tlog-proof): proof,
            # checkable offline, that this ending is in the log.
            receipt = make_receipt(self.rt.ledger, tenant, end.seq)
            (self.rt.home / "runs" / run_id / "receipt.tlog-proof").write_text(receipt)
        return self.runs.get(tenant, run_id)

    def close_asks(self, tenant: str, run_id: str, why: str) -> None:
        """Close the run's pending asks as abandoned (a failure is logged: the run's end
        is recorded all the same, and the next sweep closes them)."""
        actor = Actor("runtime", f"supervisor:{self.supervisor_id}")
        try:
            self.rt.asks.abandon_run(tenant, run_id, actor, why)
        except ProctorError as exc:
            _log.warning("run %s: its asks were not closed: %s", run_id, exc.message)

    def mark_interrupted(self, actor: Actor) -> list[RunRecord]:
        """Runs left 'running' by a supervisor that is gone, on any host (see
        ``Runtime.close_orphaned_runs``): record them as interrupted."""
        closed = self.rt.close_orphaned_runs(actor, other_hosts=True, skip=self.supervisor_id)
        return [self.runs.get(tenant, run_id) for tenant, run_id in closed]
