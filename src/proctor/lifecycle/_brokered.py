"""A sandbox run whose only way out is the broker.

The sandbox gets the run's broker socket at ``/run/proctor/broker.sock``, the
guest library mounted read-only as ``proctor_guest``, loopback-only TCP for the
shim's proxy, and the entrypoint started by the shim; with a CA bundle, that
bundle (and a Java truststore of it); with a host JRE, the JRE's configuration
directory. Nothing else of the host.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import proctor.guest
from proctor.broker import Broker, RunChannel, RunScope
from proctor.guest.protocol import RUN_ENV, SOCKET_ENV, SOCKET_PATH, TOKEN_ENV
from proctor.lifecycle._truststore import java_conf_dir, java_home, java_options, java_truststore
from proctor.sandbox import (
    GuestNetwork,
    Limits,
    SandboxDriver,
    SandboxResult,
    SandboxSpec,
    Sink,
    network_available,
)

GUEST_SOCKET = SOCKET_PATH
GUEST_LIB_PARENT = "/opt/proctor"
GUEST_LIB = f"{GUEST_LIB_PARENT}/proctor_guest"
GUEST_CA = "/opt/proctor-ca"
GUEST_DIR = Path(proctor.guest.__file__).resolve().parent


def brokered_spec(
    channel: RunChannel,
    argv: tuple[str, ...],
    *,
    code_dir: Path | None = None,
    limits: Limits | None = None,
    env: Mapping[str, str] | None = None,
    ca_dir: Path | None = None,
    network: GuestNetwork | None = None,
) -> SandboxSpec:
    """The sandbox spec of a brokered run: the shim first, then the entrypoint.

    With ``network`` (transparent egress) every connection the guest opens reaches
    the broker whatever the program; the shim's proxy keeps serving clients that
    use ``HTTP(S)_PROXY``."""
    guest_env = dict(env or {})
    guest_env.update(
        {
            "PYTHONPATH": GUEST_LIB_PARENT,
            SOCKET_ENV: GUEST_SOCKET,
            TOKEN_ENV: channel.token,
            RUN_ENV: channel.run_id,
        }
    )
    ro_dirs = {GUEST_DIR: GUEST_LIB}
    home = java_home()
    if home is not None:
        # A JRE in the sandbox: its home named (``java`` on PATH is a link through
        # /etc/alternatives, which the sandbox does not see), and its configuration
        # kept outside /usr (Debian's /etc/java-NN-openjdk) bound read-only.
        guest_env.setdefault("JAVA_HOME", str(home))
        conf = java_conf_dir(home)
        if conf is not None:
            ro_dirs[conf] = str(conf)
    if ca_dir is not None:
        # The trust bundle: the system's roots plus the tenant's CA, for hosts whose
        # credentials the broker injects (it terminates TLS for those).
        ro_dirs[ca_dir] = GUEST_CA
        # Node adds NODE_EXTRA_CA_CERTS to its own roots; the whole bundle is fine there.
        for name in (
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "NODE_EXTRA_CA_CERTS",
        ):
            guest_env[name] = f"{GUEST_CA}/bundle.pem"
        truststore = java_truststore(ca_dir)
        if truststore is not None:
            # Appended: a caller's own JVM options stay, and a later -D wins in Java.
            opts = java_options(truststore, GUEST_CA)
            given = guest_env.get("JAVA_TOOL_OPTIONS", "").strip()
            guest_env["JAVA_TOOL_OPTIONS"] = f"{given} {opts}" if given else opts
    return SandboxSpec(
        argv=("python3", "-m", "proctor_guest.shim", "--", *argv),
        code_dir=code_dir,
        env=guest_env,
        limits=limits or Limits(),
        sockets={channel.socket: GUEST_SOCKET},
        ro_dirs=ro_dirs,
        loopback_tcp=True,
        network=network,
        cwd="/code" if code_dir is not None else None,
    )


def run_brokered(
    broker: Broker,
    scope: RunScope,
    driver: SandboxDriver,
    argv: tuple[str, ...],
    *,
    code_dir: Path | None = None,
    limits: Limits | None = None,
    env: Mapping[str, str] | None = None,
    ca_dir: Path | None = None,
    on_stdout: Sink | None = None,
    on_stderr: Sink | None = None,
    cancel: threading.Event | None = None,
    transparent: bool | None = None,
) -> SandboxResult:
    """Open the run's socket (and network), run the sandbox, and close them whatever
    happens. ``transparent``: give the run a network whose every connection the
    broker decides (None: wherever the host can, :func:`network_available`)."""
    limits = limits or Limits()
    if transparent is None:
        transparent = network_available() and broker.serves_networks
    channel = broker.open_run(scope, ttl=limits.wall_seconds + 60)
    network = None
    try:
        if transparent:
            network = GuestNetwork.create()
            broker.attach_network(scope.run_id, network)
        spec = brokered_spec(
            channel, argv, code_dir=code_dir, limits=limits, env=env, ca_dir=ca_dir,
            network=network,
        )  # fmt: skip
        return driver.run(spec, on_stdout=on_stdout, on_stderr=on_stderr, cancel=cancel)
    finally:
        broker.close_run(scope.run_id)
        if network is not None:
            network.close()
