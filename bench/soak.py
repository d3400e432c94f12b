"""The load soak at full size: 32 concurrent governed runs x 1,000 mediated calls,
in waves, every call checked against the ledger; figures per wave.

Each run is a production run of one approved artifact in the runtime's default
sandbox backend; its calls are SQL reads of a real SQLite dataset and plain
HTTP through the broker's proxy to a loopback server, three in ten designed to
be refused (see bench/_soak_workload.py). This process is the runtime
(supervisor, broker, ledger writer): its RSS is sampled during each wave (peak)
and after it (end, once the wave is checked and garbage collected). Latency is
per call as the guest timed it, from the call to its answer. CPU is split
between this process and the sandboxes it waited for.

    .venv/bin/python bench/soak.py [--runs 32] [--calls 1000] [--waves 2]

Exits 1 if any check fails (a call without its event, a wrong decision, ...).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _soak_workload import Soak, WaveFigures, mib, pct


def _ms(us: float) -> str:
    return f"{us / 1000:.1f} ms"


def _row(f: WaveFigures) -> str:
    kinds = "  ".join(f"{k} {_ms(p50)}/{_ms(p99)}" for k, (p50, p99) in f.by_kind_us.items())
    return (
        f"| {f.index} | {f.runs} x {f.calls // max(f.runs, 1):,} | {f.wall:.1f} s"
        f" | {f.calls / f.wall:,.0f} | {_ms(f.p50_us)} | {_ms(f.p99_us)} | {kinds}"
        f" | {f.events:,} | {mib(f.rss_start)} / {mib(f.rss_peak)} / {mib(f.after.rss)}"
        f" | {f.after.fds} | {f.after.threads} | {f.cpu_self:.0f} s / {f.cpu_children:.0f} s"
        f" | {'ok' if not f.problems else f'{f.problems} FAILED'} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=32, help="concurrent runs per wave")
    ap.add_argument("--calls", type=int, default=1000, help="calls per run")
    ap.add_argument("--waves", type=int, default=2)
    args = ap.parse_args()
    failed = 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="proctor-soak-") as tmp:
        soak = Soak(Path(tmp), args.runs, args.calls)
        with soak.opened():
            print(
                f"load soak: {args.runs} concurrent runs x {args.calls:,} calls x {args.waves}"
                f" waves; sandbox backend {soak.backend}; Python {platform.python_version()};"
                f" {os.cpu_count()} CPUs"
            )
            print(
                "| wave | runs x calls | wall | calls/s | p50 | p99 | p50/p99 by kind | events"
                " | RSS start / peak / end | fds | threads | CPU runtime / sandboxes | checks |"
            )
            print("|" + "---|" * 13)
            for _ in range(args.waves):
                fig, chk = soak.run_wave()
                print(_row(fig), flush=True)
                for problem in chk.problems[:20]:
                    print(f"  FAILED: {problem}")
                failed += len(chk.problems)
            sockets = soak.open_sockets()
            if sockets:
                print(f"  FAILED: {len(sockets)} run sockets left open")
                failed += 1
            t0 = time.monotonic()
            size = soak.verify()
            verify_s = time.monotonic() - t0
            figs = soak.figures
            lat = [us for f in figs for us in f.latencies_us]
            calls = sum(f.calls for f in figs)
            wall = sum(f.wall for f in figs)
            first, last = figs[0], figs[-1]
            print()
            print(f"total calls: {calls:,} in {wall:.1f} s of waves: {calls / wall:,.0f} calls/s")
            print(f"latency per call (guest): p50 {_ms(pct(lat, 0.5))}, p99 {_ms(pct(lat, 0.99))}")
            print(
                f"events written in waves: {sum(f.events for f in figs):,}; tenant log size"
                f" {size:,}, verified in {verify_s:.1f} s"
            )
            print(
                f"runtime RSS end of wave 1 -> end of wave {last.index}:"
                f" {mib(first.after.rss)} -> {mib(last.after.rss)}"
                f" ({(last.after.rss - first.after.rss) / 2**20:+.1f} MiB);"
                f" Python heap blocks {first.after.blocks:,} -> {last.after.blocks:,};"
                f" fds {first.after.fds} -> {last.after.fds};"
                f" threads {first.after.threads} -> {last.after.threads}"
            )
            print(f"wall time: {time.monotonic() - started:.1f} s (set-up, waves, checks, verify)")
    if failed:
        print(f"FAILED: {failed} problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
