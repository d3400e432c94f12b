#!/usr/bin/env bash
# `make test`'s run: the tests marked host (sandboxes, mounts, namespaces, cgroups)
# in one pytest process, one at a time; every other test in a second process beside
# it (tests/host_group.py says why, and fails an unmarked test that touches the
# host). Arguments go to both. The second process's report follows the first's.
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
tmp=$(mktemp -d "${TMPDIR:-/tmp}/proctor-tests.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# Each its own base temporary directory, and no shared cache directory; the slowest
# tests named, to keep the whole run under its 12-minute bound.
"$py" -m pytest -m "not host" --basetemp="$tmp/other" -p no:cacheprovider --durations=15 "$@" \
  > "$tmp/other.log" 2>&1 &
other=$!
"$py" -m pytest -m host --basetemp="$tmp/host" -p no:cacheprovider --durations=25 "$@"
host_rc=$?
wait "$other"
other_rc=$?
echo
echo "===== the tests not marked host, run beside the ones above ====="
cat "$tmp/other.log"
echo
echo "host tests: exit $host_rc; the others: exit $other_rc"
if [ "$host_rc" -ne 0 ] || [ "$other_rc" -ne 0 ]; then
  exit 1
fi
