#!/usr/bin/env bash
# Coverage-guided fuzzing of the parsers that face untrusted input (atheris),
# for `make soak`. Each harness is bounded in time; a crash fails the target.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
SECONDS_EACH=${PROCTOR_FUZZ_SECONDS:-60}

if ! $PY -c 'import atheris' >/dev/null 2>&1; then
  $PY -m pip install -q -e '.[fuzz]' || true
fi
if ! $PY -c 'import atheris' >/dev/null 2>&1; then
  echo "fuzz: atheris does not build on this platform; the hypothesis fuzzers in tests/fuzz ran instead"
  exit 0
fi
for harness in fuzz/fuzz_*.py; do
  name=$(basename "$harness" .py)
  corpus=.fuzz-corpus/$name
  mkdir -p "$corpus"
  echo "fuzz: $name for ${SECONDS_EACH}s"
  log=$corpus.log
  rc=0
  $PY "$harness" -max_total_time="$SECONDS_EACH" -rss_limit_mb=4096 -print_final_stats=1 \
    "$corpus" >"$log" 2>&1 || rc=$?
  grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ +DONE)' "$log" || true
  if [ "$rc" -ne 0 ]; then
    tail -40 "$log" >&2
    echo "fuzz: $name failed (exit $rc); the crashing input is in the log above" >&2
    exit "$rc"
  fi
done
