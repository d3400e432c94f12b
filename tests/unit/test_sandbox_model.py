"""The sandbox's inputs refuse what cannot be built, and its public surface is exact."""

from __future__ import annotations

from pathlib import Path

import pytest

import proctor.sandbox as sandbox
from proctor.errors import SandboxError
from proctor.sandbox import Limits, SandboxSpec, SandboxSpecInvalid
from proctor.sandbox._cgroup import CgroupMode, detect
from proctor.sandbox._seccomp import DENIED_SYSCALLS, compile_bpf, oci_seccomp


def test_public_names_are_exactly_all() -> None:
    public = {n for n in dir(sandbox) if not n.startswith("_")}
    assert public == set(sandbox.__all__)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"argv": ()},
        {"argv": ("x\0y",)},
        {"argv": ("true",), "scratch_path": "relative"},
        {"argv": ("true",), "scratch_path": "/usr/scratch"},
        {"argv": ("true",), "scratch_bytes": 10},
        {"argv": ("true",), "code_dir": Path("/nonexistent/code")},
        {"argv": ("true",), "env": {"A=B": "x"}},
        {"argv": ("true",), "sockets": {Path("relative.sock"): "/run/x.sock"}},
        {"argv": ("true",), "sockets": {Path("/run/a.sock"): "/proc/x.sock"}},
        {"argv": ("true",), "sockets": {Path("/run/a.sock"): "/tmp/in-scratch.sock"}},
    ],
)
def test_spec_refuses(kwargs: dict[str, object]) -> None:
    with pytest.raises(SandboxSpecInvalid):
        SandboxSpec(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"memory_bytes": 1024}, {"pids": 0}, {"cpu": 0}, {"wall_seconds": 0}, {"output_bytes": -1}],
)
def test_limits_refuse(kwargs: dict[str, float]) -> None:
    with pytest.raises(SandboxSpecInvalid) as info:
        Limits(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, SandboxError)


def test_spec_is_frozen_against_the_callers_dict() -> None:
    env = {"A": "1"}
    spec = SandboxSpec(argv=("true",), env=env)
    env["A"] = "2"
    assert spec.env["A"] == "1"
    assert spec.guest_cwd == "/tmp"


def test_seccomp_filter_compiles_to_bpf() -> None:
    program = compile_bpf()
    assert len(program) > 8 * len(DENIED_SYSCALLS)
    assert len(program) % 8 == 0  # struct sock_filter is 8 bytes


def test_oci_seccomp_denies_the_same_calls() -> None:
    rules = oci_seccomp()["syscalls"]
    assert isinstance(rules, list)
    names = {n for rule in rules for n in rule["names"]}
    assert {"ptrace", "mount", "unshare", "setns", "bpf", "socket", "clone"} <= names


def test_cgroup_detect_v2_on_a_fake_tree(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory pids cpu\n")
    layout = detect(tmp_path)
    assert layout.mode is CgroupMode.V2
    assert layout.v2 is not None and layout.v2.is_relative_to(tmp_path)


def test_cgroup_detect_refuses_a_tree_without_controllers(tmp_path: Path) -> None:
    from proctor.sandbox import SandboxUnavailable

    with pytest.raises(SandboxUnavailable, match="not mounted"):
        detect(tmp_path)


def test_unknown_backend_is_a_usage_error() -> None:
    with pytest.raises(SandboxSpecInvalid, match="unknown sandbox backend"):
        sandbox.get_driver("docker")


def test_missing_tools_are_reported_not_raised() -> None:
    assert not sandbox.BubblewrapDriver(bwrap="/nonexistent/bwrap").status().available
    status = sandbox.GVisorDriver(runsc="/nonexistent/runsc").status()
    assert not status.available
    assert "runsc" in status.reason
