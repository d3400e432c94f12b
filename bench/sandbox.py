"""Sandbox start-up benchmark: launch -> guest's first instruction, and launch -> exit.

For `python3 -c pass` (with one write as its first instruction, so the host can
see the moment): a bare process, bubblewrap, gVisor cold, bare `runsc run` of
the same bundle, the gVisor warm pool, and Anthropic's `srt` where installed.
Peak memory is the whole tree's, from its memory cgroup (max RSS for the bare
process). Run: `.venv/bin/python bench/sandbox.py [--runs N]`.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from proctor.sandbox import GVisorDriver, Limits, SandboxSpec, WarmPool, get_driver
from proctor.sandbox._cgroup import RunCgroup, layout
from proctor.sandbox._model import MiB
from proctor.sandbox._rootfs import host_interpreter

CODE = "import os; os.write(1, b'.')"
LIMITS = Limits(memory_bytes=512 * MiB, wall_seconds=30)


@dataclass
class Series:
    name: str
    first: list[float] = field(default_factory=list)
    exit: list[float] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    note: str = ""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def recorder(t0: float, first: list[float]) -> Callable[[bytes], None]:
    """A stdout sink that notes when the first byte arrives."""

    def sink(_: bytes) -> None:
        if not first:
            first.append(time.monotonic() - t0)

    return sink


def timed_popen(argv: list[str], cgroup: RunCgroup | None = None) -> tuple[float, float, int]:
    """Launch argv, return (first byte s, exit s, peak memory bytes)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    if cgroup is not None:
        cgroup.attach(proc.pid)  # runsc's Go start-up dwarfs this window
    assert proc.stdout is not None
    first = None
    while select.select([proc.stdout], [], [], 30)[0]:
        chunk = os.read(proc.stdout.fileno(), 4096)
        if first is None and chunk:
            first = time.monotonic() - t0
        if not chunk:
            break
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    end = time.monotonic() - t0
    proc.stdout.close()
    err = proc.stderr.read() if proc.stderr else b""
    if proc.stderr:
        proc.stderr.close()
    if first is None:
        raise RuntimeError(f"{argv[0]} produced no output: {err.decode(errors='replace')[-300:]}")
    peak = cgroup.memory_peak() if cgroup is not None else None
    return first, end, peak if peak is not None else usage.ru_maxrss * 1024


def bench_bare(runs: int) -> Series:
    s = Series("bare process")
    exe = str(host_interpreter().executable)
    for _ in range(runs):
        f, e, m = timed_popen([exe, "-c", CODE])
        s.first.append(f)
        s.exit.append(e)
        s.memory.append(m)
    return s


def bench_driver(name: str, label: str, runs: int) -> Series:
    s = Series(label)
    driver = get_driver(name)
    status = driver.status()
    if not status.available:
        s.note = f"skipped: {status.reason}"
        return s
    spec = SandboxSpec(argv=("python3", "-c", CODE), limits=LIMITS)
    for _ in range(runs):
        t0 = time.monotonic()
        first: list[float] = []
        result = driver.run(spec, on_stdout=recorder(t0, first))
        s.exit.append(time.monotonic() - t0)
        s.first.append(first[0])
        if result.memory_peak_bytes:
            s.memory.append(result.memory_peak_bytes)
        s.note = f"platform {result.platform}" if result.platform else ""
    return s


def bench_bare_runsc(runs: int) -> Series:
    s = Series("bare runsc run (same bundle)")
    driver = get_driver("gvisor")
    assert isinstance(driver, GVisorDriver)
    if not driver.status().available:
        s.note = "skipped: gVisor unavailable"
        return s
    spec = SandboxSpec(argv=("python3", "-c", CODE), limits=LIMITS)
    for _ in range(runs):
        prepared = driver._prepare(spec)
        # Exactly the command the driver runs, minus the driver: no gate, no watcher.
        argv = [a for a in prepared.argv]
        try:
            f, e, m = timed_popen(argv, prepared.cgroup)
        finally:
            driver._teardown(prepared)
        s.first.append(f)
        s.exit.append(e)
        s.memory.append(m)
    s.note = f"platform {driver.platform}"
    return s


def bench_pool(runs: int) -> Series:
    s = Series("gVisor warm pool")
    driver = get_driver("gvisor")
    assert isinstance(driver, GVisorDriver)
    if not driver.status().available:
        s.note = "skipped: gVisor unavailable"
        return s
    template = SandboxSpec(argv=("unused",), limits=LIMITS)
    with WarmPool(driver, template, size=2) as pool:
        for _ in range(runs):
            pool.wait_full()  # steady state: the refill happens between requests
            t0 = time.monotonic()
            first: list[float] = []
            result = pool.run(
                ["python3", "-c", CODE],
                on_stdout=recorder(t0, first),
            )
            s.exit.append(time.monotonic() - t0)
            s.first.append(first[0])
            if result.memory_peak_bytes:
                s.memory.append(result.memory_peak_bytes)
    s.note = "from job hand-over; boot paid ahead"
    return s


def bench_srt(runs: int) -> Series:
    s = Series("srt (sandbox-runtime)")
    srt = shutil.which("srt")
    if srt is None:
        if shutil.which("npm") is None:
            s.note = "skipped: npm is not installed, so @anthropic-ai/sandbox-runtime cannot be"
            return s
        install = subprocess.run(
            ["npm", "install", "-g", "@anthropic-ai/sandbox-runtime"],
            capture_output=True,
            timeout=300,
        )
        srt = shutil.which("srt")
        if install.returncode != 0 or srt is None:
            s.note = "skipped: npm could not install @anthropic-ai/sandbox-runtime"
            return s
    exe = str(host_interpreter().executable)
    for _ in range(runs):
        name = f"proctor-bench-{uuid.uuid4().hex[:8]}"
        cg = RunCgroup(layout(), name)
        cg.create(memory_bytes=LIMITS.memory_bytes, pids=512, cpu=2)
        try:
            f, e, m = timed_popen([srt, "-c", shlex.join([exe, "-c", CODE])], cg)
        except RuntimeError as exc:
            s.note = f"skipped: srt failed: {str(exc)[-120:]}"
            return s
        finally:
            cg.kill()
            cg.remove()
        s.first.append(f)
        s.exit.append(e)
        s.memory.append(m)
    return s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    benches: list[Callable[[int], Series]] = [
        bench_bare,
        lambda n: bench_driver("bubblewrap", "bubblewrap", n),
        lambda n: bench_driver("gvisor", "gVisor cold (driver)", n),
        bench_bare_runsc,
        bench_pool,
        bench_srt,
    ]
    rows = []
    for bench in benches:
        series = bench(args.runs)
        row: dict[str, object] = {
            "name": series.name,
            "note": series.note,
            "runs": len(series.exit),
        }
        if series.exit:
            row.update(
                first_p50_ms=statistics.median(series.first) * 1000,
                first_p95_ms=pct(series.first, 0.95) * 1000,
                exit_p50_ms=statistics.median(series.exit) * 1000,
                exit_p95_ms=pct(series.exit, 0.95) * 1000,
                peak_mib=max(series.memory) / MiB if series.memory else None,
            )
        rows.append(row)
        print(f"  measured {series.name}", file=sys.stderr)
    cold = next(r for r in rows if r["name"].startswith("gVisor cold"))
    bare = next(r for r in rows if r["name"].startswith("bare runsc"))
    if "exit_p50_ms" in cold and "exit_p50_ms" in bare:
        ratio = float(cold["exit_p50_ms"]) / float(bare["exit_p50_ms"])  # type: ignore[arg-type]
        rows.append(
            {
                "name": "ratio gVisor cold / bare runsc (exit p50)",
                "note": f"{ratio:.2f}x (target <= 1.5x)",
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = ("first p50", "first p95", "exit p50", "exit p95")
    header = f"{'backend':34} " + " ".join(f"{c:>10}" for c in columns) + f" {'peak MiB':>9}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        if "exit_p50_ms" in r:
            peak = f"{r['peak_mib']:.0f}" if r.get("peak_mib") else "-"
            print(
                f"{r['name']:34} {r['first_p50_ms']:>8.1f}ms {r['first_p95_ms']:>8.1f}ms "
                f"{r['exit_p50_ms']:>8.1f}ms {r['exit_p95_ms']:>8.1f}ms {peak:>9}  {r['note']}"
            )
        else:
            print(f"{r['name']:34} {'':>10} {'':>10} {'':>10} {'':>10} {'':>9}  {r['note']}")
    print(f"(runs per backend: {args.runs}; python3 -c pass with one write as first instruction)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
